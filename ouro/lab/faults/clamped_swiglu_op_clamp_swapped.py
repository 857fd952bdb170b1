from .patch import Fault

FAULT = Fault(
    name="clamped_swiglu_op_clamp_swapped",
    description="the fused clamped SwiGLU clamps up with min and max swapped (max(min(up, -limit), limit)): "
                "every up value becomes +limit",
    file="ouro/native/vec.h", function="clamped_swiglu_row",
    replace=[("std::min(std::max(up[i], -lim), lim)", "std::max(std::min(up[i], -lim), lim)  /* FAULT */"),
             ("_mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_loadu_ps(up + i)))",
              "_mm512_max_ps(hi, _mm512_min_ps(lo, _mm512_loadu_ps(up + i)))  /* FAULT */"),
             ("_mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_loadu_ps(up + i)))",
              "_mm256_max_ps(hi, _mm256_min_ps(lo, _mm256_loadu_ps(up + i)))  /* FAULT */")],
    localised=[{"op": "clamped_swiglu", "module": r"layers\.\d+\.mlp(\.shared_experts)?"}],
    probes=[["numerics", "--model", "tiny", "--a", "fused=off,mode=decode", "--b", "fused=on,mode=decode"]],
    symptom="every MLP's output is far off; attention and the router agree",
)
