"""The MoE router (product, sigmoid, bias, group-limited top-k, normalise, scale) as one op
(`router.cpp`)."""

from __future__ import annotations

import torch

from .kernels import ops, register_fakes, usable

FAMILY = "router"


def can(*tensors) -> bool:
    return usable(FAMILY, *tensors)


def route(x, weight, bias, top_k: int, n_group: int, topk_group: int, norm_topk: bool, scaling: float):
    """x [T, D], weight [E, D], bias [E] -> (weights [T, top_k] float32, experts [T, top_k] int64)."""
    return ops(FAMILY).route(x, weight, bias, top_k, n_group, topk_group, norm_topk, scaling)


@register_fakes(FAMILY)
def _fakes():
    torch.library.register_fake("ouro_native::route")(
        lambda x, weight, bias, top_k, n_group, topk_group, norm_topk, scaling:
        (x.new_empty(x.shape[0], top_k, dtype=torch.float32), x.new_empty(x.shape[0], top_k, dtype=torch.long)))
