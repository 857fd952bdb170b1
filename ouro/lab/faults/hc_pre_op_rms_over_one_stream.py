from .patch import Fault

FAULT = Fault(
    name="hc_pre_op_rms_over_one_stream",
    description="the fused hyper-connection weights take the mean square over D (one stream's width) "
                "instead of n * D (all the token's streams): the RMS is sqrt(n) too large",
    file="ouro/native/mhc.cpp", function="finish",
    replace=[("ouro::sumsq(rows[k], n * D) / static_cast<float>(n * D) + h.norm_eps",
              "ouro::sumsq(rows[k], n * D) / static_cast<float>(D) /* FAULT: n * D */ + h.norm_eps")],
    localised=[{"op": "hc_pre", "module": r"layers\.0\.attn_hc"}],
    probes=[["numerics", "--model", "tiny", "--a", "fused=off,mode=decode", "--b", "fused=on,mode=decode"]],
    symptom="decoded text is wrong from the first layer on; every hyper-connection's gates are flatter",
)
