"""Single-step gated delta rule for decode: one new token per sequence, state updated in place."""

import torch


def kda_recurrent_step(q, k, v, g, beta, state):
    """q, k: [N, H, dk], v: [N, H, dv], g: [N, H, dk], beta: [N, H]; state: [N, H, dk, dv] fp32,
    updated in place. Returns o [N, H, dv] (float32)."""
    state.mul_(g.float().exp().unsqueeze(-1))
    pred = torch.einsum("nhk,nhkv->nhv", k.float(), state)
    u = beta.float().unsqueeze(-1) * (v.float() - pred)
    state.add_(k.float().unsqueeze(-1) * u.unsqueeze(-2))
    return torch.einsum("nhk,nhkv->nhv", q.float(), state)
