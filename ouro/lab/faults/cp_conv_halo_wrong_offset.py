from .patch import Fault

FAULT = Fault(
    name="cp_conv_halo_wrong_offset",
    description="a context-parallel rank takes its short-conv halo one token early from the previous rank's slice",
    file="ouro/parallel/cp_kda.py", function="conv_halo",
    replace=[("lead = last_columns(padded, lengths - m, K1)",
              "lead = last_columns(padded, (lengths - m - 1).clamp_min(0), K1)  # FAULT")],
    localised=[{"op": "causal_conv1d", "layer": 0}, {"file": "ouro/parallel/cp_kda.py", "function": ["conv_halo"]}],
    probes=[["numerics", "--model", "tiny", "--a", "cp=1", "--b", "cp=2"]],
    symptom="prompts prefilled across ranks differ from single-rank prefill right after each cut",
)
