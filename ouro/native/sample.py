"""Sampling's pick and its log-probability over the vocabulary in one call (`sample.cpp`)."""

from __future__ import annotations

import torch

from .kernels import ops, register_fakes, usable

FAMILY = "sample"


def can(logits: torch.Tensor) -> bool:
    """Sampling needs no autograd whatever the grad mode: only a logits tensor that wants gradients
    keeps torch's path (as do rows that are not contiguous, which the op refuses)."""
    with torch.no_grad():
        return not logits.requires_grad and logits.stride(-1) == 1 and usable(FAMILY, logits)


def pick_logprobs(logits: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] float32 (rows contiguous), chosen int64 [B] (-1: the row's first maximum) ->
    (ids int64 [B], log_softmax(logits)[b, ids[b]] float32 [B])."""
    return ops(FAMILY).pick_logprobs(logits, chosen)


@register_fakes(FAMILY)
def _fakes():
    torch.library.register_fake("ouro_native::pick_logprobs")(
        lambda logits, chosen: (chosen.new_empty(chosen.shape), logits.new_empty(chosen.shape)))
