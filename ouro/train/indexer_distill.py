"""Training the DSA lightning indexer by distillation, as DSA does.

transformers runs the indexer under `no_grad` and has no indexer loss, so a trained trunk would
select pools with a random indexer. Here each DSA layer's input is captured (a forward pre-hook),
and after the forward pass two distributions over the *complete, visible* pools of every query
are built from it:

- the target: the main attention's probability mass per pool, summed over heads, computed
  densely (every causal key, not only the selected ones) and detached;
- the indexer's: softmax of its pool scores, recomputed with gradients (the layer input is
  detached, so only the indexer's own weights learn from this loss).

The loss is KL(target || indexer). The always-appended tail pool is not part of either. Rows with
no complete visible pool are skipped. `recall` measures what the selection is for: of the
top-k pools by dense attention mass, the share the indexer also puts in its top k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .hf_model import dsa_attentions


class LayerInputs:
    """Captures the hidden states each DSA attention module is called with."""

    def __init__(self, model):
        self.attns = dsa_attentions(model)
        self.inputs: dict[str, torch.Tensor] = {}
        self.handles = [a.register_forward_pre_hook(self._hook(name), with_kwargs=True) for name, a in self.attns]

    def _hook(self, name):
        def hook(module, args, kwargs):
            self.inputs[name] = (kwargs.get("hidden_states") if "hidden_states" in kwargs else args[0])
        return hook

    def clear(self):
        self.inputs.clear()

    def remove(self):
        for h in self.handles:
            h.remove()


@torch.no_grad()
def query_latent(attn, x: torch.Tensor) -> torch.Tensor:
    """The q LoRA latent both the main attention and the indexer read."""
    return attn.q_a_layernorm(attn.q_a_proj(x))


@torch.no_grad()
def dense_pool_mass(attn, x: torch.Tensor, kpool: int, q_resid: torch.Tensor | None = None) -> torch.Tensor:
    """[B, S, P] mean-over-heads probability mass of causal dense attention on each complete pool."""
    b, s, _ = x.shape
    q_resid = query_latent(attn, x) if q_resid is None else q_resid
    q = attn.q_b_proj(q_resid).view(b, s, -1, attn.qk_head_dim).transpose(1, 2)
    kv_pass, k_rot = torch.split(attn.kv_a_proj_with_mqa(x), [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
    k_pass = attn.kv_a_layernorm(kv_pass).view(b, 1, s, attn.kv_lora_rank)
    k, _ = attn.expand_kv(k_pass, k_rot.view(b, 1, s, attn.qk_rope_head_dim))
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * attn.scaling
    causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1).mean(1)         # [B, S, S]
    p = s // kpool
    return probs[..., : p * kpool].reshape(b, s, p, kpool).sum(-1)


def indexer_pool_scores(attn, x: torch.Tensor, q_resid: torch.Tensor | None = None) -> torch.Tensor:
    """[B, S, P] the indexer's score of each complete pool (with gradients to its weights), the
    same computation transformers' indexer runs before its top-k."""
    ind = attn.indexer
    b, s, _ = x.shape
    q_resid = query_latent(attn, x) if q_resid is None else q_resid
    q = ind.wq_b(q_resid).view(b, s, -1, ind.head_dim)
    k = ind.k_norm(ind.wk(x))
    gate = F.linear(x, ind.index_kpool_compress_gate)
    packed = torch.cat([k, gate, torch.ones(b, s, 1, dtype=x.dtype, device=x.device)], dim=-1)
    pool_keys, _, _ = ind.get_pooled_states(packed_states=packed)                  # complete pools
    scores = F.relu(torch.matmul(q.float(), pool_keys.float().transpose(-1, -2).unsqueeze(1)) * ind.softmax_scale)
    weights = ind.weights_proj(x).float() * ind.n_heads ** -0.5
    return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)


def candidate_mask(s: int, p: int, kpool: int, device) -> torch.Tensor:
    """[S, P]: pool j is selectable for query t when its last token (j*kpool + kpool-1) <= t."""
    ends = torch.arange(p, device=device) * kpool + kpool - 1
    return ends[None, :] <= torch.arange(s, device=device)[:, None]


@dataclass
class DistillStats:
    loss: torch.Tensor
    recall: float           # mean over rows with more candidates than the top-k keeps
    chance: float           # the recall a random selection would get on the same rows
    rows: int


def distill(attn, x: torch.Tensor, kpool: int, topk_pools: int) -> DistillStats:
    x = x.detach()
    q_resid = query_latent(attn, x)
    target = dense_pool_mass(attn, x, kpool, q_resid)
    scores = indexer_pool_scores(attn, x, q_resid)
    b, s, p = target.shape
    scores = scores[..., :p]
    cand = candidate_mask(s, p, kpool, x.device)[None].expand(b, -1, -1)
    rows = cand.any(-1)
    target = target * cand
    target = target / target.sum(-1, keepdim=True).clamp_min(1e-30)
    logp = scores.masked_fill(~cand, -1e9).log_softmax(-1)
    kl = (torch.xlogy(target, target) - target * logp).sum(-1)
    loss = kl[rows].mean() if rows.any() else scores.sum() * 0.0
    recall, chance, n = selection_recall(target.detach(), scores.detach(), cand, topk_pools)
    return DistillStats(loss, recall, chance, n)


@torch.no_grad()
def selection_recall(target, scores, cand, k: int) -> tuple[float, float, int]:
    """Of dense attention's top-k candidate pools, the share also in the indexer's top-k; over
    rows with more than k candidates (others select everything). Also chance = k / candidates."""
    n_cand = cand.sum(-1)
    rows = n_cand > k
    if not rows.any():
        return float("nan"), float("nan"), 0
    t = target.masked_fill(~cand, -1.0)[rows]
    sc = scores.masked_fill(~cand, float("-inf"))[rows]
    top_t = t.topk(k, dim=-1).indices
    top_s = sc.topk(k, dim=-1).indices
    hit = (top_t[:, :, None] == top_s[:, None, :]).any(-1).float().mean(-1)
    return hit.mean().item(), (k / n_cand[rows].float()).mean().item(), int(rows.sum())
