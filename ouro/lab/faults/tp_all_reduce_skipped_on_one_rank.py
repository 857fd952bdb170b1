from .patch import Fault

FAULT = Fault(
    name="tp_all_reduce_skipped_on_one_rank",
    description="under tensor parallelism rank 1 skips the all-reduce of every row-parallel projection (o_proj, "
                "the dense MLP's down_proj): its partial sums go on alone, and the ranks' collectives pair wrongly",
    file="ouro/parallel/tp_layers.py", function="row_parallel_reduce",
    replace=[("return all_reduce(out, group, key)",
              "return out if dist.get_rank(group) == 1 else all_reduce(out, group, key)  # FAULT: rank 1 skips")],
    localised=[{"module": r"layers\.0\.self_attn\.o_proj"}],
    probes=[["numerics", "--model", "tiny", "--a", "tp=1", "--b", "tp=2"]],
    symptom="ouro serve --tp 2 answers garbage or stops on a collective error; --tp 1 is fine",
)
