from .patch import Fault

FAULT = Fault(
    name="experts_op_down_pair_copied",
    description="the fused routed-experts op (streamed form, decode) writes the first of each pair of down-projection rows into both "
                "outputs (every odd hidden channel a copy of the even one before it)",
    file="ouro/native/experts.cpp", function="streamed",
    replace=[("s.y[(r + i) * D + d2] = v[4 + i];", "s.y[(r + i) * D + d2] = v[i];  // FAULT: the pair's second row")],
    localised=[{"op": "moe_experts", "module": r"layers\.\d+\.mlp\.experts$"}],
    probes=[["numerics", "--model", "tiny", "--a", "fused=off,mode=decode", "--b", "fused=on,mode=decode"]],
    symptom="decoded text is wrong in the sparse layers; dense layers and attention agree",
)
