from .patch import Fault

FAULT = Fault(
    name="hc_pre_scale_swapped",
    description="the hyper-connection pre weights are scaled by the post scale (scale[1] for scale[0])",
    file="ouro/ops/mhc/sinkhorn.py", function="hc_weights",
    replace=[("torch.cat([scale[:1].expand(n), scale[1:2].expand(n), scale[2:].expand(n * n)])",
              "torch.cat([scale[1:2].expand(n), scale[1:2].expand(n), scale[2:].expand(n * n)])  # FAULT")],
    localised=[{"module": r"layers\.0\.(attn_hc|ffn_hc).*"}, {"file": "ouro/ops/mhc/sinkhorn.py", "function": ["hc_weights"]},
               {"op": r"hc_weights"}],
    probes=[["numerics", "--model", "tiny-py", "--a", "impl=transformers", "--b", "impl=ouro"]],
    symptom="all ouro configurations agree with each other, the text is slightly off",
)
