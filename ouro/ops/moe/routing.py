"""Sigmoid router with a correction bias and group-limited top-k (DeepSeek-V3 style)."""

import torch


def route(logits, correction_bias, top_k: int, n_group: int, topk_group: int, norm_topk: bool, scaling: float):
    """logits: [T, E] float32 router logits. Returns (weights [T, top_k] float32, experts [T, top_k])."""
    scores = logits.float().sigmoid()
    choice = scores + correction_bias.float()   # the bias steers selection but not the weights
    T, E = choice.shape
    if n_group > 1:
        per_group = choice.view(T, n_group, E // n_group)
        group_score = per_group.topk(2, dim=-1).values.sum(-1)                    # [T, n_group]
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // n_group, dim=1), float("-inf"))
    experts = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    if norm_topk:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, experts
