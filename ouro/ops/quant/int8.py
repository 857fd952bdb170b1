"""Symmetric int8 quantisation and the int8 product's exact references.

W8A8: weights per output channel and activations per token (row) are quantised the same way:
each row its own scale `amax / 127`, values rounded to [-127, 127] (never -128, which is what lets
the AVX2 kernel's sign trick stay exact). A row's quantisation depends on that row alone, so a
request's result never depends on the rows it shares a batch with. Products accumulate in int32
exactly; `dequantize` applies the two scales."""

import torch

QMAX = 127
# a row of zeros gets scale 0 (and q = 0); dividing by this instead keeps the arithmetic finite
_TINY = torch.finfo(torch.float32).tiny


def quantize_rows(x):
    """x [..., K] float -> (q int8 [..., K], scale float32 [...]), scale = amax(|row|) / 127.
    A NaN or inf in a row makes its scale non-finite, so the row's output shows it."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / QMAX
    q = torch.round(x / scale.clamp_min(_TINY).unsqueeze(-1)).clamp_(-QMAX, QMAX)
    return q.to(torch.int8), scale


def dequantize(acc, x_scale, w_scale):
    """int32 accumulators [M, N] -> float32: acc * x_scale[m] * w_scale[n]."""
    return acc.float() * x_scale.unsqueeze(-1) * w_scale


def int8_mm_naive(x, w):
    """Reference: int8 x [M, K] @ int8 w [N, K].T in float64 (exact: |sum| <= K * 127^2 < 2^53) -> int32."""
    return (x.double() @ w.double().T).to(torch.int32)


# float32 holds every integer below 2^24 exactly; a chunk of 1024 products of |.| <= 127^2 sums
# to at most 16,516,096 < 16,777,216, so each chunk's BLAS product is exact
CHUNK_K = 1024


def int8_mm_chunked(x, w):
    """The same product through float32 BLAS, exact: K in chunks of CHUNK_K, each chunk's product
    rounded back to int32 and summed in int32. A fallback where no int8 kernel runs (slow: the
    weight chunk is converted on every call)."""
    acc = None
    for k in range(0, x.shape[1], CHUNK_K):
        part = torch.round(x[:, k:k + CHUNK_K].float() @ w[:, k:k + CHUNK_K].float().T).to(torch.int32)
        acc = part if acc is None else acc.add_(part)
    return acc if acc is not None else torch.zeros(x.shape[0], w.shape[0], dtype=torch.int32)


def w8a8_linear_naive(x, qweight, weight_scale):
    """Reference W8A8 product: x [..., K] float, qweight int8 [N, K], weight_scale [N] -> float32
    [..., N]; every row quantised on its own, the integer product exact."""
    flat = x.reshape(-1, x.shape[-1])
    q, s = quantize_rows(flat)
    return dequantize(int8_mm_naive(q, qweight), s, weight_scale).view(*x.shape[:-1], qweight.shape[0])


def w8a8_experts_naive(x, weights, experts, gate_up_q, gate_up_scale, down_q, down_scale, limit: float,
                       linear=w8a8_linear_naive):
    """Reference: every token, every chosen expert, one at a time, each product W8A8 (`linear`: the
    reference product of the weights' kind, int8 or FP8)."""
    from ..moe import clamped_swiglu
    out = torch.full_like(x, float("nan"))
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=torch.float32)
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            gate, up = linear(x[t:t + 1], gate_up_q[e], gate_up_scale[e])[0].chunk(2)
            h = clamped_swiglu(gate, up, limit).unsqueeze(0)
            acc += weights[t, j].float() * linear(h, down_q[e], down_scale[e])[0]
        out[t] = acc.to(x.dtype)
    return out
