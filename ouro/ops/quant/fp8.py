"""FP8 W8A8 (`--quantization fp8`): weights in float8 e4m3 with one scale per output channel,
activations in e4m3 with one scale per token (row), computed on the fly, the same rule as int8
W8A8: a row's result depends on that row alone. Scale = amax / 448 (e4m3's largest value); a row
of zeros gets scale 0 and q = 0; a NaN or inf makes the row's scale non-finite.

The reference product is exact: an e4m3 x e4m3 product has at most 8 significant bits and every
product and partial sum of a row lies within 2^-18 .. 2^40, so float64 adds them without rounding;
the scales are applied after, in float64, and the result rounded once to float32."""

import torch

E4M3 = torch.float8_e4m3fn
FP8_MAX = 448.0
_TINY = torch.finfo(torch.float32).tiny


def quantize_rows_fp8(x):
    """x [..., K] float -> (q e4m3 [..., K], scale float32 [...]), scale = amax(|row|) / 448."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / FP8_MAX
    q = (x / scale.clamp_min(_TINY).unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX)
    return q.to(E4M3), scale


def fp8_linear_naive(x, qweight, weight_scale):
    """Reference FP8 product: x [..., K] float, qweight e4m3 [N, K], weight_scale [N] -> float32
    [..., N]; every row quantised on its own, the product exact in float64."""
    flat = x.reshape(-1, x.shape[-1])
    q, s = quantize_rows_fp8(flat)
    acc = q.double() @ qweight.double().T
    out = acc * s.double().unsqueeze(-1) * weight_scale.double()
    return out.float().view(*x.shape[:-1], qweight.shape[0])
