from .patch import Fault

FAULT = Fault(
    name="tp_rank_loads_rank0_shard",
    description="under tensor parallelism every rank slices rank 0's part of each split weight",
    file="ouro/parallel/tp_shard.py", function="_rows",
    replace=[("return t.narrow(dim, rank * n, n).clone()",
              "return t.narrow(dim, 0, n).clone()  # FAULT: rank 0's shard on every rank")],
    localised=[{"module": r"layers\.0\."}, {"layer": 0}],
    probes=[["numerics", "--model", "tiny", "--a", "tp=1", "--b", "tp=2"]],
    symptom="ouro serve --tp 2 answers nonsense from the first token; --tp 1 is fine",
)
