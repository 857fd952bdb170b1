from ..fault_patch import Fault

FAULT = Fault(
    name="hc_pre_scale_swapped",
    description="the hyper-connection pre weights are scaled by the post scale (scale[1] for scale[0])",
    file="ouro/ops/mhc/sinkhorn.py", function="hc_weights",
    replace=[("pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps",
              "pre = torch.sigmoid(pre_w * scale[1] + pre_b) + hc_eps  # FAULT")],
    localised=[{"module": r"layers\.0\.(attn_hc|ffn_hc).*"}, {"file": "ouro/ops/mhc/sinkhorn.py", "function": ["hc_weights"]},
               {"op": r"hc_weights"}],
    probes=[["numerics", "--model", "tiny-py", "--a", "impl=transformers", "--b", "impl=ouro"]],
    symptom="all ouro configurations agree with each other, the text is slightly off",
)
