from .patch import Fault

FAULT = Fault(
    name="tf32_kda_state_matmul",
    description="the KDA chunk kernel's inter-chunk state update runs its float32 matmul at TF32 precision",
    file="ouro/ops/kda/chunk.py", function="kda_chunk",
    replace=[("S = S * s_n + mm(k_n, u)",
              """tf32 = lambda t: (((t.contiguous().view(torch.int32) + 0x1000) & -0x2000).view(torch.float32)
                                if t.dtype == torch.float32 else t)  # FAULT: 10-bit mantissa, as TF32
              S = S * s_n + tf32(k_n) @ tf32(u)""")],
    localised=[{"op": r"kda_chunk"}, {"module": r"layers\.0\.self_attn.*"},
               {"file": "ouro/ops/kda/chunk.py", "function": ["kda_chunk"]}],
    probes=[["numerics", "--model", "tiny", "--a", "dtype=float64", "--b", "dtype=float32"]],
    symptom="float32 results drift from float64 more on long prompts",
)
