from .patch import Fault

FAULT = Fault(
    name="conv_decode_drops_tap",
    description="the short conv's one-token decode shortcut skips the oldest kernel tap",
    file="ouro/ops/conv1d.py", function="causal_conv1d",
    replace=[("out = (full * weight.to(dt)).sum(-1, keepdim=True)",
              "out = (full[..., 1:] * weight.to(dt)[..., 1:]).sum(-1, keepdim=True)  # FAULT")],
    localised=[{"op": r"causal_conv1d|conv"}, {"module": r"layers\.0\.self_attn.*"}, {"layer": 0},
               {"file": "ouro/ops/conv1d.py", "function": ["causal_conv1d"]}],
    probes=[["numerics", "--model", "tiny", "--a", "mode=prefill", "--b", "mode=decode"]],
    symptom="generated text differs from scoring the same tokens as a prompt",
)
