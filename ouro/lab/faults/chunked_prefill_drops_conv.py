from .patch import Fault

FAULT = Fault(
    name="chunked_prefill_drops_conv",
    description="chunked prefill drops the KDA short-conv window between chunks",
    file="ouro/layers/kda.py", function="KDAttention._forward",
    replace=[("ctx.conv_window(padded, conv_state, lengths), lengths)",
              "(conv_state if ctx.is_decode else torch.zeros_like(conv_state)), lengths)  # FAULT")],
    localised=[{"module": r"layers\.0\.self_attn.*"}, {"layer": 0}, {"op": r"causal_conv1d|conv"},
               {"file": "ouro/layers/kda.py", "function": ["_forward"]}],
    probes=[["numerics", "--model", "tiny", "--a", "impl=ouro", "--b", "chunk=17"]],
    symptom="long prompts (chunked prefill) give different answers than short ones",
)
