"""Reference gated delta rule (KDA), one token at a time. Slow and obviously right; the tests'
yardstick for the chunked and recurrent forms."""

import torch


def kda_naive(q, k, v, g, beta, initial_state=None):
    """q, k: [B, T, H, dk] (already L2-normed and scaled), v: [B, T, H, dv],
    g: [B, T, H, dk] log-decay (<= 0), beta: [B, T, H].
    Returns (o [B, T, H, dv], final_state [B, H, dk, dv]); everything in float32."""
    B, T, H, dk = k.shape
    dv = v.shape[-1]
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    S = torch.zeros(B, H, dk, dv) if initial_state is None else initial_state.float().clone()
    out = torch.empty(B, T, H, dv)
    for t in range(T):
        S = S * g[:, t].exp()[..., None]                     # per-key-channel forget
        pred = torch.einsum("bhk,bhkv->bhv", k[:, t], S)     # what the memory recalls for k_t
        u = beta[:, t, :, None] * (v[:, t] - pred)            # delta-rule correction
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        out[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], S)
    return out, S
