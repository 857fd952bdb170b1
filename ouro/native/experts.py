"""The routed experts of a step with a few rows per expert, float32, as one op (`experts.cpp`)."""

from __future__ import annotations

import torch

from .kernels import ops, register_fakes, usable

FAMILY = "experts"
# up to this many (token, choice) pairs per expert on average the op streams each expert's weights
# for its rows; past it (long prefill chunks) a BLAS product per expert is as fast. Measured on
# `small` (E 32, k 4, 2 threads, AVX2, medians of 7): op / padded batched matmul 5.2 / 10.0 ms at
# 128 tokens (16 rows an expert), 9.4 / 12.5 at 256, 17.3 / 19.1 at 512 (64 rows), 27.5 / 27.4 at 768
MAX_ROWS_PER_EXPERT = 64


def can(*tensors) -> bool:
    return usable(FAMILY, *tensors)


def moe_experts(x, weights, experts, gate_up, down, limit: float):
    return ops(FAMILY).moe_experts(x, weights, experts, gate_up, down, limit)


@register_fakes(FAMILY)
def _fakes():
    torch.library.register_fake("ouro_native::moe_experts")(
        lambda x, weights, experts, gate_up, down, limit: torch.empty_like(x))
