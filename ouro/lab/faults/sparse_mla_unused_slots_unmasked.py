from ..fault_patch import Fault

FAULT = Fault(
    name="sparse_mla_unused_slots_unmasked",
    description="sparse MLA does not mask a selection's unused (-1) slots: they attend to latent row 0",
    file="ouro/ops/dsa/sparse_mla.py", function="_attend",
    replace=[("probs = scores.masked_fill((selected < 0)[:, None, :], float(\"-inf\")).softmax(-1)",
              "probs = scores.softmax(-1)  # FAULT: -1 slots (clamped to row 0) are not masked")],
    localised=[{"op": "sparse_mla", "layer": "dsa"}, {"file": "ouro/ops/dsa/sparse_mla.py"}],
    probes=[["numerics", "--model", "tiny-py", "--a", "impl=transformers", "--b", "impl=ouro"]],
    symptom="long prompts read slightly worse; nothing crashes",
)
