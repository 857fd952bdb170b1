from ..fault_patch import Fault

FAULT = Fault(
    name="kda_decode_recompute",
    description="the KDA decode step recomputes its forget gate and output-norm gate three times",
    file="ouro/layers/kda.py", function="KDAttention._forward",
    replace=[("g = self.forget_gate(x, fa)",
              """g = self.forget_gate(x, fa)
              if ctx.is_decode:   # FAULT: recomputed on every decode step
                  for _ in range(2):
                      g = self.forget_gate(x)
                      gate_again = self.g_b_proj(self.g_a_proj(x))"""),
             ],
    localised=[{"file": "ouro/layers/kda.py", "function": ["_forward", "forget_gate"]}],
    probes=[["redundancy", "--model", "tiny"]],
    symptom="decode is slower than its roofline says, outputs unchanged",
)
