from .patch import Fault

# Planted before the path is chosen: the routed experts run as one native call (`w8a8_experts`,
# host float32 rows where ouro's kernel is the form), through `w8a8_grouped` (ouro's kernel or
# expert by expert through `w8a8_product`), or padded (a graph); the fault must be the same bug on
# every machine, so it shifts the scales every path reads.
FAULT = Fault(
    name="w8a8_expert_scales_shifted",
    description="the W8A8 routed experts apply expert e-1's per-channel weight scales to expert e's rows "
                "(in every path: the fused op, every int8 product form)",
    file="ouro/quant/w8a8.py", function="W8A8Experts.eager",
    replace=[('(gate_up_q, gate_up_scale), (down_q, down_scale) = parts["gate_up_proj"], parts["down_proj"]',
              'parts = {n: (q, s.roll(1, 0)) for n, (q, s) in parts.items()}   # FAULT: each expert gets its '
              'neighbour\'s scales\n'
              '(gate_up_q, gate_up_scale), (down_q, down_scale) = parts["gate_up_proj"], parts["down_proj"]')],
    localised=[{"module": r"layers\.1\.mlp\.experts"}],
    probes=[["numerics", "--model", "tiny", "--a", "quant=w8a8_ref", "--b", "quant=w8a8"]],
    symptom="--quantization w8a8 loses far more accuracy than int8 should, in the MoE layers only",
)
