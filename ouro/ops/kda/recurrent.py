"""Single-step gated delta rule for decode: one new token per sequence, state updated in place."""

import torch


def kda_recurrent_step(q, k, v, g, beta, state):
    """q, k: [N, H, dk], v: [N, H, dv], g: [N, H, dk], beta: [N, H]; state: [N, H, dk, dv] fp32,
    updated in place. Returns o [N, H, dv] (float32)."""
    N, H, dk = k.shape
    dv = v.shape[-1]
    S = state.view(N * H, dk, dv)                      # batched matmuls; no permuting copies
    k1 = k.float().reshape(N * H, 1, dk)
    S.mul_(g.float().exp().reshape(N * H, dk, 1))
    pred = torch.bmm(k1, S)                            # what the memory recalls for k: [NH, 1, dv]
    u = beta.float().reshape(N * H, 1, 1) * (v.float().reshape(N * H, 1, dv) - pred)
    S.baddbmm_(k1.transpose(1, 2), u)                  # S += k^T u
    return torch.bmm(q.float().reshape(N * H, 1, dk), S).view(N, H, dv)
