from .patch import Fault

FAULT = Fault(
    name="mla_decode_expands_latent",
    description="DSA attention expands the MLA latent into per-head K and V over the whole cache (slow, still correct)",
    file="ouro/layers/dsa.py", function="DSAttention._attend_native",
    replace=[("_, q_lat, w_uv = absorb_queries(q, w_uk, w_uv, self.scale)",
              """flat = storage[0]
              rows = cache_rows(ctx, ctx.seq_index, selection)   # FAULT: per-head K/V of every cache row
              kv = (flat.float() @ self.kv_b_proj.weight.float().T).view(flat.shape[0], self.H, -1)
              k_sel, v_sel = kv[..., :self.qk][rows.clamp(min=0)], kv[..., self.qk:][rows.clamp(min=0)]
              scores = torch.einsum("nhd,nwhd->nhw", q.float(), k_sel) * self.scale
              probs = scores.masked_fill((rows < 0)[:, None, :], float("-inf")).softmax(-1)
              return torch.einsum("nhw,nwhv->nhv", probs, v_sel).to(q.dtype)""")],
    localised=[{"module": r"layers\.\d+\.self_attn.*", "layer": "dsa"},
               {"file": "ouro/layers/dsa.py", "function": ["_forward", "_attend_native"]}, {"file": "ouro/ops/dsa/sparse_mla.py"}],
    probes=[["redundancy", "--model", "tiny"]],
    symptom="decode gets slower as the cache grows; outputs are right",
)
