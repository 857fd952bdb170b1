from .patch import Fault

FAULT = Fault(
    name="tp_a_log_not_sliced",
    description="under tensor parallelism every rank keeps the first heads' A_log (the KDA decay rates) "
                "instead of its own heads' slice",
    file="ouro/parallel/tp_shard.py", function="_shard_kda",
    replace=[('_param(m, "A_log", rank, size)',
              '_param(m, "A_log", 0, size)  # FAULT: rank 0\'s heads\' A_log on every rank')],
    localised=[{"module": r"layers\.0\.self_attn"}, {"layer": 0}],
    probes=[["numerics", "--model", "tiny-py", "--a", "tp=1", "--b", "tp=2"]],
    symptom="with --tp 2 the text is a little worse than with --tp 1; every rank runs without error",
)
