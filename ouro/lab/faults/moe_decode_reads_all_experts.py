from .patch import Fault

FAULT = Fault(
    name="moe_decode_reads_all_experts",
    description="at batch-1 decode the routed experts multiply the token by every expert's weights and keep the "
                "chosen experts' rows, instead of gathering only the k experts the router chose (E/k times the "
                "routed experts' weight bytes; outputs unchanged)",
    file="ouro/ops/moe/experts.py", function="_experts_gathered",
    replace=[("gate, up = torch.bmm(gate_up[flat], xs).squeeze(-1).chunk(2, dim=-1)",
              "rows = torch.arange(T * k)   # FAULT: every expert's weights read, the chosen rows kept\n"
              "gate, up = torch.matmul(gate_up, xs.squeeze(-1).T).permute(2, 0, 1)[rows, flat].chunk(2, dim=-1)"),
             ("y = torch.bmm(down[flat], clamped_swiglu(gate, up, limit).unsqueeze(-1)).squeeze(-1)",
              "y = torch.matmul(down, clamped_swiglu(gate, up, limit).T).permute(2, 0, 1)[rows, flat]  # FAULT")],
    localised=[{"file": "ouro/ops/moe/experts.py", "function": ["_experts_gathered"],
                "module": r"layers\.\d+\.mlp\.experts"}],
    # the eager experts (the fused op's reference, a machine without a compiler): the fused op reads only
    # the chosen experts whatever this code does
    probes=[["redundancy", "--model", "tiny", "--fused", "off"]],
    symptom="batch-1 decode is slower than its roofline says (more so with more experts), outputs unchanged",
)
