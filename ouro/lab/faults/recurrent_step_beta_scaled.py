from .patch import Fault

FAULT = Fault(
    name="recurrent_step_beta_scaled",
    description="the KDA decode step scales the delta-rule update by 0.9 (beta applied wrongly)",
    file="ouro/ops/kda/recurrent.py", function="kda_recurrent_step",
    replace=[("u = beta.float().reshape(N * H, 1, 1) * (v.float().reshape(N * H, 1, dv) - pred)",
              "u = 0.9 * beta.float().reshape(N * H, 1, 1) * (v.float().reshape(N * H, 1, dv) - pred)  # FAULT")],
    localised=[{"op": r"kda_recurrent_step"}, {"file": "ouro/ops/kda/recurrent.py"}],
    probes=[["numerics", "--model", "tiny", "--a", "mode=prefill", "--b", "mode=decode"]],
    symptom="generated text differs from scoring the same tokens as a prompt",
)
