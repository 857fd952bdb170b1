"""Routed experts, batched by expert: tokens are grouped per expert and each active expert runs
one matmul over its tokens."""

import torch
import torch.nn.functional as F

from .. import batch_invariant
from ..capture import reads_host


def clamped_swiglu(gate, up, limit: float):
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


# Up to this many tokens the padded batched matmul beats one matmul per expert even at E = 8k:
# at T rows an fp32 weight byte feeds T/2 FLOPs, under a CPU's balance of ~6-8 FLOP/byte. Measured
# on `small` (E=32, k=4, 2 threads, 7 layers of distinct weights, interleaved medians): padded /
# per-expert time 0.88 at T=8, 0.82 at T=16, 0.80 at T=32 (all faster beyond noise).
PAD_ROWS = 32
# Where the busiest expert's row count can be read for free (a CPU tensor, no graph being
# captured), every expert is padded to that count instead of to T: always up to PAD_ROWS tokens,
# beyond that while the padding at most doubles the work (E * busiest <= PAD_WASTE * T * k). Measured on `small`, 7 layers, 2 threads:
# 41 / 54 / 87 / 527 ms against 53 / 94 / 148 / 552 ms for the previous choice at T = 16 / 64 /
# 256 / 2048 (pad to T for T <= 32, else one matmul per expert).
# That was float32 (MKL: a product per expert pays a fixed cost that padding saves). bfloat16 products
# run oneDNN's kernels, whose batched matmul is ~1.13x its per-expert loop, so padding pays only while
# it adds little: a 16 x 512 bfloat16 prefill of `small` (Zen 4, 2 threads, real routing padding the
# busiest expert 1.4-1.8x the mean) took 2,144 ms at 1.15 against 2,344 at 2.0, alternating runs.
PAD_WASTE = 2.0
PAD_WASTE_16BIT = 1.15


def pad_waste(dtype) -> float:
    """How much padding the batched matmul may add (E * busiest <= this * T * k) for `dtype`."""
    return PAD_WASTE if dtype in (torch.float32, torch.float64) else PAD_WASTE_16BIT


def experts_grouped(x, weights, experts, gate_up, down, limit: float):
    """x: [T, D]; weights, experts: [T, k]; gate_up: [E, 2I, D]; down: [E, D, I]. Returns [T, D].

    A handful of tokens (T*k <= E/4: batch-1 decode): each (token, choice) gathers its expert's
    weights and runs one batched matrix-vector product: only the chosen experts are read, with no
    device-to-host read. Otherwise every expert's tokens are padded to a common row count and all
    experts run as one batched matmul (one pass over the weights, no per-expert Python):
    - on a CPU (`reads_host`) the count is the busiest expert's, up to PAD_ROWS tokens always and
      beyond while that at most doubles the work (float32; `pad_waste`: 1.15x for 16-bit); past
      that (prefill with routing piled onto a few experts) one matmul per active expert;
    - where the step must stay capturable (an accelerator, a compiled graph) the count is T, a
      bound known on the host (a token picks an expert at most once), while the padded matmul
      stays memory-bound (T <= PAD_ROWS) or the padding is at most 4x (T*k <= 4E, E <= 4k);
      otherwise (prefill) one matmul per active expert."""
    T, k = experts.shape
    E = gate_up.shape[0]
    if batch_invariant.enabled():   # one form for every batch: each expert's rows as one product
        return experts_looped(x, weights, experts, lambda h, e: h @ gate_up[e].T, lambda h, e: h @ down[e].T, limit, E)
    if 4 * T * k <= E:     # a few tokens, most experts idle: read only the chosen ones
        return _experts_gathered(x, weights, experts, gate_up, down, limit)
    flat, order, counts, x_sorted = by_expert(x, experts, E)
    rows = None
    if reads_host(counts):
        busiest = int(counts.max())
        rows = busiest if T <= PAD_ROWS or E * busiest <= pad_waste(x.dtype) * T * k else None
    elif T <= PAD_ROWS or (T * k <= 4 * E and E <= 4 * k):   # an expert holds at most T rows: pad to T
        rows = T
    if rows is not None:
        y_sorted = _experts_padded(x_sorted, flat[order], counts, rows, gate_up, down, limit)
    else:
        y_sorted = _per_expert(x_sorted, counts, lambda h, e: h @ gate_up[e].T, lambda h, e: h @ down[e].T, limit)
    return combine(y_sorted, order, weights, T, k, x.dtype)


def experts_looped(x, weights, experts, up, down, limit: float, num_experts: int):
    """The per-expert loop with the products supplied: up(rows, e) = rows @ gate_up[e].T and
    down(h, e) = h @ down[e].T (a caller with pre-packed weights runs its own kernel). Exact rows,
    no padding; reads the per-expert counts on the host."""
    T, k = experts.shape
    _, order, counts, x_sorted = by_expert(x, experts, num_experts)
    return combine(_per_expert(x_sorted, counts, up, down, limit), order, weights, T, k, x.dtype)


def by_expert(x, experts, E):
    """(flat choices, their order grouped by expert, rows per expert [E], token copies in that order)."""
    flat = experts.flatten()
    order = flat.argsort(stable=True)
    counts = torch.zeros(E, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    return flat, order, counts, x[order // experts.shape[1]]


def _per_expert(x_sorted, counts, up, down, limit):
    y_sorted = torch.full_like(x_sorted, float("nan"))
    start = 0
    for e, c in enumerate(counts.tolist()):
        if c == 0:
            continue
        gate, up_part = up(x_sorted[start:start + c], e).chunk(2, dim=-1)
        y_sorted[start:start + c] = down(clamped_swiglu(gate, up_part, limit), e)
        start += c
    return y_sorted


def combine(y_sorted, order, weights, T, k, dtype):
    """Back to (token, choice) order, then a weighted sum over the k choices (no scatter-add)."""
    y = torch.empty_like(y_sorted)
    y[order] = y_sorted
    return _weighted_sum(y, weights, T, k, dtype)


def _weighted_sum(y, weights, T, k, dtype):
    """y: [T*k, D] in (token, choice) order -> [T, D], each token's k outputs weighted. (einsum
    takes another contraction path for T = 1, so batch-invariant runs spell out the product.)"""
    if batch_invariant.enabled():
        return torch.bmm(weights.to(dtype).unsqueeze(1), y.view(T, k, -1)).squeeze(1)
    return torch.einsum("tkd,tk->td", y.view(T, k, -1), weights.to(dtype))


def _experts_padded(x_sorted, expert_of, counts, busiest, gate_up, down, limit):
    return padded_by_expert(x_sorted, expert_of, counts, busiest, gate_up.shape[0],
                            lambda h: torch.bmm(h, gate_up.transpose(1, 2)), lambda h: torch.bmm(h, down.transpose(1, 2)),
                            limit)


def padded_by_expert(x_sorted, expert_of, counts, busiest, E, up, down, limit):
    """Every expert's rows padded with zeros to `busiest` rows, [E, busiest, D], through
    up(h [E, B, D]) -> [E, B, 2I] and down(h [E, B, I]) -> [E, B, D]; no host read (capturable)."""
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(len(expert_of), device=x_sorted.device) - starts[expert_of]
    padded = x_sorted.new_zeros(E, busiest, x_sorted.shape[1])
    padded[expert_of, slot] = x_sorted
    gate, up_part = up(padded).chunk(2, dim=-1)
    return down(clamped_swiglu(gate, up_part, limit))[expert_of, slot]


def _experts_gathered(x, weights, experts, gate_up, down, limit):
    T, k = experts.shape
    flat = experts.flatten()
    xs = x.repeat_interleave(k, dim=0).unsqueeze(-1)               # [T*k, D, 1], (token, choice) order
    gate, up = torch.bmm(gate_up[flat], xs).squeeze(-1).chunk(2, dim=-1)
    y = torch.bmm(down[flat], clamped_swiglu(gate, up, limit).unsqueeze(-1)).squeeze(-1)
    return _weighted_sum(y, weights, T, k, x.dtype)


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
