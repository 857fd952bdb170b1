from .patch import Fault

FAULT = Fault(
    name="kda_decode_rate_not_exp",
    description="the fused KDA ops (decode step and prefill, one kernel) take A_log itself as the forget gate's rate (exp dropped)",
    file="ouro/native/kda.cpp", function="kda_sequences",
    replace=[("const float rate = std::exp(ap[h]);", "const float rate = ap[h];  // FAULT: the rate is exp(A_log)")],
    localised=[{"op": "kda_decode", "layer": 0}, {"op": "kda_prefill", "layer": 0}],
    probes=[["numerics", "--model", "tiny", "--a", "fused=off,mode=decode", "--b", "fused=on,mode=decode"]],
    symptom="text drifts from the eager path's from the first token: prefill and decode both run the kernel",
)
