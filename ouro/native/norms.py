"""Fused RMSNorm, sigmoid-gated RMSNorm and clamped SwiGLU (`norms.cpp`)."""

from __future__ import annotations

import torch

from .kernels import ops, register_fakes, usable

FAMILY = "norms"


def can(*tensors) -> bool:
    return usable(FAMILY, *tensors)


def rms_norm(x, weight, eps: float):
    return ops(FAMILY).rms_norm(x, weight, eps)


def gated_rms_norm(x, gate, weight, eps: float):
    return ops(FAMILY).gated_rms_norm(x, gate, weight, eps)


def clamped_swiglu(gate, up, limit: float):
    return ops(FAMILY).clamped_swiglu(gate, up, limit)


@register_fakes(FAMILY)
def _fakes():
    torch.library.register_fake("ouro_native::rms_norm")(lambda x, weight, eps: torch.empty_like(x))
    torch.library.register_fake("ouro_native::gated_rms_norm")(lambda x, gate, weight, eps: torch.empty_like(x))
    torch.library.register_fake("ouro_native::clamped_swiglu")(
        lambda gate, up, limit: gate.new_empty(gate.shape))
