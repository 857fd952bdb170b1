from .patch import Fault

FAULT = Fault(
    name="mlp_swiglu_gate_up_swapped",
    description="the dense MLP and shared expert put up_proj through the SiLU and gate_proj on the linear side "
                "(the clamped SwiGLU's arguments swapped)",
    file="ouro/layers/moe.py", function="MLP.forward",
    replace=[("return self.down_proj(fused_norms.clamped_swiglu(gate, up, self.limit))",
              "return self.down_proj(fused_norms.clamped_swiglu(up, gate, self.limit))  # FAULT: swapped"),
             ("return self.down_proj(clamped_swiglu(gate, up, self.limit))",
              "return self.down_proj(clamped_swiglu(up, gate, self.limit))  # FAULT: swapped")],
    localised=[{"module": r"layers\.0\.mlp$", "op": "clamped_swiglu"}],
    probes=[["numerics", "--model", "tiny-py", "--a", "impl=transformers", "--b", "impl=ouro"]],
    symptom="the trained model's text is worse everywhere; every ouro configuration agrees with every other",
)
