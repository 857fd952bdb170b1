from .patch import Fault

FAULT = Fault(
    name="route_op_scale_inside_ternary",
    description="the fused router applies routed_scaling_factor inside the ternary's unnormalised branch "
                "(norm ? w / sum : w * scale): normalised weights lose the scale",
    file="ouro/native/router.cpp", function="select",
    replace=[("w[j] = (norm_topk ? w[j] / div : w[j]) * scale;",
              "w[j] = norm_topk ? w[j] / div : w[j] * scale;  // FAULT: the scale applies to both")],
    localised=[{"op": "route", "module": r"layers\.\d+\.mlp\.gate"}],
    probes=[["numerics", "--model", "tiny", "--a", "fused=off,mode=decode", "--b", "fused=on,mode=decode"]],
    symptom="decoded text is off in the sparse layers; the experts chosen are right, their outputs too small",
)
