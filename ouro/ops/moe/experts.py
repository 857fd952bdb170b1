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
    x_sorted = x[order // k]                       # token copies grouped by expert
    y_sorted = torch.full_like(x_sorted, float("nan"))
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        gate, up = (x_sorted[start:start + c] @ gate_up[e].T).chunk(2, dim=-1)
        y_sorted[start:start + c] = clamped_swiglu(gate, up, limit) @ down[e].T
        start += c
    # back to (token, choice) order, then a weighted sum over the k choices (no scatter-add)
    y = torch.empty_like(y_sorted)
    y[order] = y_sorted
    return torch.einsum("tkd,tk->td", y.view(T, k, -1), weights.to(x.dtype))


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
