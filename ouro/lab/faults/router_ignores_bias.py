from .patch import Fault

FAULT = Fault(
    name="router_ignores_bias",
    description="the MoE router selects experts without e_score_correction_bias",
    file="ouro/layers/moe.py", function="Router.forward",
    replace=[("return fused_router.route(x, self.weight, self.e_score_correction_bias, *self.args)",
              "return fused_router.route(x, self.weight, torch.zeros_like(self.e_score_correction_bias), *self.args)  # FAULT"),
             ("route(logits, self.e_score_correction_bias, *self.args)",
              "route(logits, torch.zeros_like(self.e_score_correction_bias), *self.args)  # FAULT")],
    localised=[{"module": r"layers\.\d+\.mlp(\.gate)?"}, {"file": "ouro/layers/moe.py", "function": ["forward"]},
               {"file": "ouro/ops/moe/routing.py"}],
    probes=[["numerics", "--model", "tiny-py", "--a", "impl=transformers", "--b", "impl=ouro"]],
    symptom="the trained model's text is a little worse; every ouro configuration agrees with every other",
)
