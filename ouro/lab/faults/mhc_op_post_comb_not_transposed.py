from .patch import Fault

FAULT = Fault(
    name="mhc_op_post_comb_not_transposed",
    description="the fused hyper-connection merge mixes the streams by comb, not its transpose "
                "(new stream i takes comb[i, j] of stream j)",
    file="ouro/native/mhc.cpp", function="token",
    replace=[("c[i][1 + j] = comb[(t * n + j) * n + i];", "c[i][1 + j] = comb[(t * n + i) * n + j];  // FAULT: not transposed")],
    localised=[{"op": "hc_post_pre", "module": r"layers\.\d+\.(attn|ffn)_hc"}],
    probes=[["numerics", "--model", "tiny", "--a", "fused=off,mode=decode", "--b", "fused=on,mode=decode"]],
    symptom="decoded text is wrong from the first layer on; prefill and decode disagree",
)
