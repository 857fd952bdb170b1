from ..fault_patch import Fault

FAULT = Fault(
    name="clamped_swiglu_op_clamp_swapped",
    description="the fused clamped SwiGLU clamps up with min and max swapped (max(min(up, -limit), limit)): "
                "every up value becomes +limit",
    file="ouro/native/norms.cpp", function="clamped_swiglu",
    replace=[("std::min(std::max(u[i], -lim), lim)", "std::max(std::min(u[i], -lim), lim)  /* FAULT */")],
    localised=[{"op": "clamped_swiglu", "module": r"layers\.\d+\.mlp(\.shared_experts)?"}],
    probes=[["numerics", "--model", "tiny", "--a", "fused=off,mode=decode", "--b", "fused=on,mode=decode"]],
    symptom="every MLP's output is far off; attention and the router agree",
)
