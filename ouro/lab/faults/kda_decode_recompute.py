from .patch import Fault

FAULT = Fault(
    name="kda_decode_recompute",
    description="the KDA decode step recomputes its forget gate and output-norm gate three times",
    file="ouro/layers/kda.py", function="KDAttention._fused",
    replace=[("fa, ga, b = project(x, self.f_a_proj, self.g_a_proj, self.b_proj)",
              """fa, ga, b = project(x, self.f_a_proj, self.g_a_proj, self.b_proj)
              for _ in range(2):   # FAULT: the gates' products recomputed on every decode step
                  fa = self.f_a_proj(x)
                  ga = self.g_a_proj(x)
                  gate_again = self.g_b_proj(ga)"""),
             ],
    localised=[{"file": "ouro/layers/kda.py", "function": ["_fused", "_forward", "forget_gate"]},
               {"module": r"layers\.\d+\.self_attn\.(f_a_proj|g_a_proj|g_b_proj)$"}],
    probes=[["redundancy", "--model", "tiny"]],
    symptom="decode is slower than its roofline says, outputs unchanged",
)
