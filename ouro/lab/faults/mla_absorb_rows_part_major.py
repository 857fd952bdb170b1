from .patch import Fault

FAULT = Fault(
    name="mla_absorb_rows_part_major",
    description="MLA's absorbed weights read kv_b_proj's rows part-major (every head's key rows, then every head's "
                "value rows) instead of head by head: each head attends with other heads' key and value maps",
    file="ouro/ops/dsa/sparse_mla.py", function="absorb_weights",
    replace=[("w = kv_b_weight.view(n_heads, qk_dim + v_dim, -1)",
              "w = kv_b_weight.view(qk_dim + v_dim, n_heads, -1).transpose(0, 1)  # FAULT: part-major rows")],
    localised=[{"module": r"layers\.3\.self_attn\.kv_b_proj$", "function": "absorb_weights"}],
    probes=[["numerics", "--model", "tiny-py", "--a", "impl=transformers", "--b", "impl=ouro"]],
    symptom="the trained model's text is worse everywhere; every ouro configuration agrees with every other",
)
