"""Routed experts, batched by expert: tokens are grouped per expert and each active expert runs
one matmul over its tokens."""

import torch
import torch.nn.functional as F


def clamped_swiglu(gate, up, limit: float):
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


def experts_grouped(x, weights, experts, gate_up, down, limit: float):
    """x: [T, D]; weights, experts: [T, k]; gate_up: [E, 2I, D]; down: [E, D, I]. Returns [T, D]."""
    T, k = experts.shape
    flat = experts.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    token_of = order // k
    w_sorted = weights.flatten()[order].to(x.dtype)
    out = torch.zeros_like(x)
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        rows = token_of[start:start + c]
        h = x[rows] @ gate_up[e].T
        gate, up = h.chunk(2, dim=-1)
        y = (clamped_swiglu(gate, up, limit) @ down[e].T) * w_sorted[start:start + c, None]
        out.index_add_(0, rows, y)
        start += c
    return out


def experts_naive(x, weights, experts, gate_up, down, limit: float):
    """Reference: every token, every chosen expert, one at a time."""
    out = torch.full_like(x, float("nan"))
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t])
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            acc += weights[t, j] * (down[e] @ clamped_swiglu(gate, up, limit))
        out[t] = acc
    return out
