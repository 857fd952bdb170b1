from ..fault_patch import Fault

FAULT = Fault(
    name="sparse_mla_unused_slots_unmasked",
    description="sparse MLA over a prefill chunk does not mask a selection's unused (-1) slots: they attend to token 0",
    file="ouro/ops/dsa/sparse_mla.py", function="sparse_mla_chunk",
    replace=[("keep.scatter_(1, sel.masked_fill(sel < 0, seen), True)",
              "keep.scatter_(1, sel.clamp(min=0), True)  # FAULT: -1 slots (clamped to token 0) are not masked")],
    localised=[{"op": "sparse_mla_chunk", "layer": "dsa"}, {"file": "ouro/ops/dsa/sparse_mla.py"}],
    probes=[["numerics", "--model", "tiny-py", "--a", "impl=transformers", "--b", "impl=ouro"]],
    symptom="long prompts read slightly worse; nothing crashes",
)
