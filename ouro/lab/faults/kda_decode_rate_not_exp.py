from ..fault_patch import Fault

FAULT = Fault(
    name="kda_decode_rate_not_exp",
    description="the fused KDA decode op takes A_log itself as the forget gate's rate (exp dropped)",
    file="ouro/native/kda.cpp", function="kda_decode",
    replace=[("const float rate = std::exp(ap[h]);", "const float rate = ap[h];  // FAULT: the rate is exp(A_log)")],
    localised=[{"op": "kda_decode", "layer": 0}],
    probes=[["numerics", "--model", "tiny", "--a", "fused=off,mode=decode", "--b", "fused=on,mode=decode"]],
    symptom="decoded text drifts from what the same prompt gives in a prefill; prefill itself is right",
)
