from .patch import Fault

FAULT = Fault(
    name="tp_mla_o_proj_not_reduced",
    description="under tensor parallelism the MLA (DSA) attention's o_proj is split by rows but never joins an "
                "all-reduce: each rank goes on with its own heads' partial sum, and every rank skips it alike",
    file="ouro/parallel/tp_shard.py", function="_shard_dsa",
    replace=[("_row(m.o_proj, rank, size, group)",
              "_row(m.o_proj, rank, size, group, reduce=False)  # FAULT: the partial sums are never added up")],
    localised=[{"module": r"layers\.\d+\.self_attn\.o_proj$", "layer": "dsa"}],
    probes=[["numerics", "--model", "tiny", "--a", "tp=1", "--b", "tp=2"]],
    symptom="ouro serve --tp 2 answers worse than --tp 1; no collective error, KDA-only models fine",
)
