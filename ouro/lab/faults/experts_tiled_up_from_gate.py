from .patch import Fault

FAULT = Fault(
    name="experts_tiled_up_from_gate",
    description="the fused routed-experts op's tiled form (prefill) takes each hidden channel's up value from its "
                "gate channel in the first product's epilogue",
    file="ouro/native/experts.cpp", function="tiled",
    replace=[("c + i * PANEL + half, m, s.lim);", "c + i * PANEL, m, s.lim);  // FAULT: up read from the gate half")],
    localised=[{"op": "moe_experts", "module": r"layers\.\d+\.mlp\.experts$"}],
    probes=[["numerics", "--model", "tiny", "--a", "fused=off", "--b", "fused=on"]],
    symptom="prompts score wrong in the sparse layers past a few dozen tokens; decode and short prompts agree",
)
