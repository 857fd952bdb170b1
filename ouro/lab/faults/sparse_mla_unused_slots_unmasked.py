from .patch import Fault

FAULT = Fault(
    name="sparse_mla_unused_slots_unmasked",
    description="sparse MLA does not mask a selection's unused (-1) slots: they attend to token 0",
    file="ouro/layers/dsa.py", function="DSAttention._attend_native",
    replace=[("o_lat = mla.sparse_mla_decode(q_lat, *storage, GROUP, selection, ctx.page_table, ctx.seq_index,",
              "o_lat = mla.sparse_mla_decode(q_lat, *storage, GROUP, selection.clamp(min=0), ctx.page_table, "
              "ctx.seq_index,  # FAULT: -1 slots (clamped to token 0) are not masked")],
    localised=[{"op": "sparse_mla_decode", "layer": "dsa"}, {"file": "ouro/layers/dsa.py"}],
    probes=[["numerics", "--model", "tiny-py", "--a", "impl=transformers", "--b", "impl=ouro"]],
    symptom="long prompts read slightly worse; nothing crashes",
)
