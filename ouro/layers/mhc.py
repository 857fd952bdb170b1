"""mHC: the residual is `hc_mult` streams; each block reads a weighted sum of them and writes back
through post (its output) and comb (a doubly-stochastic mix of the streams)."""

import torch
from torch import nn

from ..native import mhc as fused
from ..ops.mhc import hc_weights
from .precision import KeepFloat32
from .watch import watched


def hc_pre(streams, fn, base, scale, norm_eps: float, hc_eps: float, iters: int):
    """The block's input (pre-weighted sum of the streams) and the post / comb mixing weights."""
    pre, post, comb = hc_weights(streams, fn, base, scale, norm_eps, hc_eps, iters)
    # a [1, n] x [n, D] product per token, in float32 as the reference computes it
    return (pre.unsqueeze(1) @ streams.float()).squeeze(1).to(streams.dtype), post, comb


class HyperConnection(KeepFloat32):
    """forward and mix run the fused ops (`ouro.native.mhc`) where they apply, and the eager code
    below (their reference) where a hook watches the module: a probe tapping it then sees the code
    as written, and a fault planted there shows."""
    FLOAT32 = ("base", "scale")

    def __init__(self, config):
        super().__init__()
        n, D = config.hc_mult, config.hidden_size
        self.n = n
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * D))
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))
        self.norm_eps, self.hc_eps, self.iters = config.rms_norm_eps, config.hc_eps, config.hc_sinkhorn_iters

    def forward(self, streams):
        """streams [T, n, D] -> (block input [T, D], post [T, n], comb [T, n, n])."""
        if fused.can(streams, self.fn, self.base, self.scale) and not watched(self):
            return fused.hc_pre(streams, *self._weights())
        return hc_pre(streams, self.fn, self.base, self.scale, self.norm_eps, self.hc_eps, self.iters)

    def mix(self, block_out, streams, post, comb):
        """The block's output written back: new stream i = post_i * block_out + sum_j comb[j, i] *
        stream j. A method of the hyper-connection, so each mix is tapped under its own name
        (`layers.N.attn_hc.mix`, `layers.N.ffn_hc.mix`)."""
        if fused.can(streams, block_out, post, comb) and not watched(self):
            return fused.hc_post(block_out, streams, post, comb)
        dt = streams.dtype
        return post.to(dt).unsqueeze(-1) * block_out.unsqueeze(1) + comb.to(dt).transpose(-1, -2) @ streams

    def mix_then(self, nxt, block_out, streams, post, comb):
        """`self.mix`, then `nxt`'s forward on the new streams, as one op while the new streams are in
        cache (`hc_post_pre`): where the fused kernels apply and neither hyper-connection is watched
        (a tap on either sees it run as written). Returns (new streams, nxt's output), or (new
        streams, None): then the caller runs nxt itself, as a module."""
        if fused.can(streams, block_out, post, comb, nxt.fn, nxt.base, nxt.scale) and not watched(self, nxt):
            streams, *weights = fused.hc_post_pre(block_out, streams, post, comb, *nxt._weights())
            return streams, tuple(weights)
        return self.mix(block_out, streams, post, comb), None

    def _weights(self):
        return self.fn, self.base, self.scale, self.norm_eps, self.hc_eps, self.iters


class HyperHead(nn.Module):
    """The streams collapsed into one row per token at the top of the model: their unweighted mean
    (transformers' `hc_head`). A module, so the lab taps it under that name."""

    def forward(self, streams):
        """streams [T, n, D] -> [T, D]."""
        return streams.mean(1)
