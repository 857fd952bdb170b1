from .patch import Fault

FAULT = Fault(
    name="gated_rms_norm_op_gate_from_x",
    description="the fused gated RMSNorm takes the sigmoid of the normed input's own row instead of the gate",
    file="ouro/native/norms.cpp", function="gated_rms_norm_f32",
    replace=[("ouro::sigmoid_row(out, g, D);", "ouro::sigmoid_row(out, row, D);  // FAULT: sigmoid(gate)")],
    localised=[{"op": "gated_rms_norm", "module": r"layers\.\d+\.self_attn\.o_norm"}],
    probes=[["numerics", "--model", "tiny", "--a", "fused=off,mode=decode", "--b", "fused=watched,mode=decode"]],
    symptom="the KDA layers' outputs are wrong wherever a layer runs its pieces eagerly (watched by a probe, deterministic inference, speculative replay, CP); the fused KDA ops are right",
)
