from .patch import Fault

FAULT = Fault(
    name="kda_forget_gate_rate_not_exp",
    description="the KDA forget gate takes A_log itself as the decay rate (exp dropped)",
    file="ouro/layers/kda.py", function="KDAttention.forget_gate",
    replace=[("rate = self.A_log.to(cdt).exp().view(1, self.H, 1)",
              "rate = self.A_log.to(cdt).view(1, self.H, 1)  # FAULT: the rate is exp(A_log)")],
    localised=[{"op": "forget_gate", "layer": 0}, {"file": "ouro/layers/kda.py", "function": ["forget_gate"]}],
    probes=[["numerics", "--model", "tiny-py", "--a", "impl=transformers", "--b", "impl=ouro"]],
    symptom="the trained model's text is a little worse; every ouro configuration agrees with every other",
)
