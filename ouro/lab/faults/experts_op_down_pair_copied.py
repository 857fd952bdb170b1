from .patch import Fault

FAULT = Fault(
    name="experts_op_down_pair_copied",
    description="the fused routed-experts op (streamed form, float32 weights, decode) reads each odd down-projection row as the even one before it "
                "(every odd hidden channel a copy of the even one before it)",
    file="ouro/native/experts.cpp", function="down_task",
    replace=[("dot_rows(We + d * I, h, c, I, v);",
              "dot_rows(We + (d & ~int64_t(1)) * I, h, c, I, v);  // FAULT: an odd row read as the even one")],
    localised=[{"op": "moe_experts", "module": r"layers\.\d+\.mlp\.experts$"}],
    probes=[["numerics", "--model", "tiny", "--a", "fused=off,mode=decode", "--b", "fused=on,mode=decode"]],
    symptom="decoded text is wrong in the sparse layers; dense layers and attention agree",
)
