from .patch import Fault

FAULT = Fault(
    name="rms_norm_op_eps_outside_root",
    description="the fused RMSNorm adds eps after the square root instead of under it",
    file="ouro/native/norms.cpp", function="rms_norm_f32",
    replace=[("const float inv = 1.f / std::sqrt(ouro::sumsq(row, D) / static_cast<float>(D) + e);",
              "const float inv = 1.f / (std::sqrt(ouro::sumsq(row, D) / static_cast<float>(D)) + e);  // FAULT")],
    localised=[{"op": "rms_norm", "module": r"(layers\.\d+\.(input_layernorm|post_attention_layernorm|self_attn\.(q_a|kv_a)_layernorm)|norm)$"}],
    probes=[["numerics", "--model", "tiny", "--a", "fused=off", "--b", "fused=on"]],
    symptom="every norm's output is off by a small relative amount that grows as rows get small",
)
