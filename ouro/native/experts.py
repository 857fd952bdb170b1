"""The routed experts of a step, float32, as one op (`experts.cpp`): the streamed form for a few rows
an expert, the tiled form (a grouped GEMM with the SwiGLU in its first product's epilogue) past that."""

from __future__ import annotations

import torch

from .kernels import ops, register_fakes, usable

FAMILY = "experts"
# From this many (token, choice) pairs per expert on average the tiled form beats streaming each
# expert's weights for its rows. Measured on `small` (E 32, k 4, I 256, D 512, 2 threads, AVX2,
# medians of 5), streamed / tiled ms: 5.5 / 6.2 at 16 rows an expert, 9.8 / 9.1 at 32, 18.2 / 14.5
# at 64, 78 / 49 at 256 (the padded batched matmul it replaces there: 63).
TILED_ROWS_PER_EXPERT = 24


def can(*tensors) -> bool:
    return usable(FAMILY, *tensors)


def tiled_for(experts, num_experts: int) -> bool:
    """Whether the (token, choice) pairs `experts` [T, k] give the tiled form enough rows an expert."""
    return experts.numel() >= TILED_ROWS_PER_EXPERT * num_experts


def moe_experts(x, weights, experts, gate_up, down, limit: float, tiled: bool = False):
    """x [T, D], weights/experts [T, k], gate_up [E, 2I, D], down [E, D, I] -> [T, D]."""
    return ops(FAMILY).moe_experts(x, weights, experts, gate_up, down, limit, tiled)


@register_fakes(FAMILY)
def _fakes():
    torch.library.register_fake("ouro_native::moe_experts")(
        lambda x, weights, experts, gate_up, down, limit, tiled=False: torch.empty_like(x))
