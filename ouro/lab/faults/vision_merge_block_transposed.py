from .patch import Fault

FAULT = Fault(
    name="vision_merge_block_transposed",
    description="the vision tower's 2x2 spatial merge reads each block's patches column by column: rows and "
                "columns swapped against the downsample kernel's layout",
    file="ouro/layers/vision.py", function="PatchDownsample.forward",
    replace=[("blocks = x.view(-1, m, m, x.shape[-1]).permute(0, 3, 1, 2).flatten(1)",
              "blocks = x.view(-1, m, m, x.shape[-1]).permute(0, 3, 2, 1).flatten(1)  # FAULT: (column, row) order")],
    localised=[{"module": r"visual\.downsample$", "file": "ouro/layers/vision.py"}],
    probes=[["vision", "--model", "tiny-vl"]],
    symptom="answers about images mix up what is left and right of what; text-only prompts are unaffected",
)
