from .patch import Fault

FAULT = Fault(
    name="tp_shared_expert_not_reduced",
    description="under tensor parallelism the MoE all-reduces the routed experts' partial sums and adds its rank's "
                "shared-expert partial (down_proj split by rows) afterwards: every rank issues the same collectives, "
                "but each holds its own wrong layer output",
    file="ouro/parallel/tp_layers.py", function="ShardedMoE.forward",
    replace=[("return all_reduce(with_shared(self, routed, x), self.group, self.group_key)",
              "return with_shared(self, all_reduce(routed, self.group, self.group_key), x)  # FAULT: partial left out")],
    localised=[{"module": r"layers\.1\.mlp$", "layer": 1}],
    probes=[["numerics", "--model", "tiny", "--a", "tp=1", "--b", "tp=2"]],
    symptom="ouro serve --tp 2 answers worse than --tp 1 on MoE models; no collective error, dense models fine",
)
