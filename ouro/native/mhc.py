"""Fused mHC hyper-connection ops (`mhc.cpp`): hc_pre (weights and block input), hc_post (the mix
back into the streams) and hc_post_pre (a mix and the next hyper-connection's weights in one call).
A token's results depend on that token only: deterministic mode uses them too."""

from __future__ import annotations

import torch

from .kernels import ops, register_fakes, usable

FAMILY = "mhc"


MAX_STREAMS = 16      # mhc.cpp's MAX_N: an n x n mixing matrix lives on the stack


def can(streams, *tensors) -> bool:
    """The fused ops run `streams` [..., n, D] (and the other tensors): n up to MAX_STREAMS."""
    return streams.dim() >= 2 and streams.shape[-2] <= MAX_STREAMS and usable(FAMILY, streams, *tensors)


def hc_pre(streams, fn, base, scale, norm_eps: float, hc_eps: float, iters: int):
    """streams [T, n, D] -> (block input [T, D], post [T, n], comb [T, n, n])."""
    return ops(FAMILY).hc_pre(streams, fn, base, scale, norm_eps, hc_eps, iters)


def hc_post(block_out, streams, post, comb):
    """New streams [T, n, D]: stream i = post_i * block_out + sum_j comb[j, i] * stream j."""
    return ops(FAMILY).hc_post(block_out, streams, post, comb)


def hc_post_pre(block_out, streams, post, comb, fn, base, scale, norm_eps: float, hc_eps: float, iters: int):
    """hc_post, then hc_pre of the next hyper-connection (fn, base, scale, ...) on the new streams:
    (new streams, block input, post, comb)."""
    return ops(FAMILY).hc_post_pre(block_out, streams, post, comb, fn, base, scale, norm_eps, hc_eps, iters)


def _weights_like(streams):
    # the block input in the streams' dtype, the mixing weights in float32 (as the eager path gives them)
    T, n, D = streams.shape
    return streams.new_empty(T, D), streams.new_empty(T, n, dtype=torch.float32), streams.new_empty(T, n, n, dtype=torch.float32)


@register_fakes(FAMILY)
def _fakes():
    torch.library.register_fake("ouro_native::hc_pre")(lambda streams, *rest: _weights_like(streams))
    torch.library.register_fake("ouro_native::hc_post")(
        lambda block_out, streams, post, comb: streams.new_empty(streams.shape))
    torch.library.register_fake("ouro_native::hc_post_pre")(
        lambda block_out, streams, *rest: (streams.new_empty(streams.shape), *_weights_like(streams)))
