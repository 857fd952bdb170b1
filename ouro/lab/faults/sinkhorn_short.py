from ..fault_patch import Fault

FAULT = Fault(
    name="sinkhorn_short",
    description="the hyper-connection Sinkhorn normalisation runs one iteration fewer than trained",
    file="ouro/ops/mhc/sinkhorn.py", function="sinkhorn",
    replace=[("for _ in range(iters - 1):", "for _ in range(iters - 2):  # FAULT")],
    localised=[{"module": r"layers\.0\.(attn_hc|ffn_hc).*"}, {"file": "ouro/ops/mhc/sinkhorn.py"},
               {"op": r"sinkhorn|hc_weights"}],
    probes=[["numerics", "--model", "tiny", "--a", "impl=transformers", "--b", "impl=ouro"]],
    symptom="all ouro configurations agree with each other, the text is slightly off",
)
