from .patch import Fault

FAULT = Fault(
    name="image_rows_one_position_off",
    description="a prefill chunk writes each image row one position after its image token",
    file="ouro/engine/model_runner.py", function="image_rows",
    replace=[("rows += [start + o for o in offsets]", "rows += [start + min(o + 1, n - 1) for o in offsets]  # FAULT")],
    localised=[{"file": "ouro/engine/model_runner.py", "function": ["image_rows"]}],
    probes=[["vision", "--model", "tiny-vl"]],
    symptom="image answers degrade; the vision tower alone checks out against the reference",
)
