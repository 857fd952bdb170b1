"""The routed experts of a step with a few rows per expert, float32, as one op (`experts.cpp`)."""

from __future__ import annotations

import torch

from .kernels import ops, register_fakes, usable

FAMILY = "experts"
# up to this many (token, choice) pairs per expert on average the op streams each expert's weights
# for its rows; past it (prefill) a BLAS product per expert wins
MAX_ROWS_PER_EXPERT = 8


def can(*tensors) -> bool:
    return usable(FAMILY, *tensors)


def moe_experts(x, weights, experts, gate_up, down, limit: float):
    return ops(FAMILY).moe_experts(x, weights, experts, gate_up, down, limit)


@register_fakes(FAMILY)
def _fakes():
    torch.library.register_fake("ouro_native::moe_experts")(
        lambda x, weights, experts, gate_up, down, limit: torch.empty_like(x))
