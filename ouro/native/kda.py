"""The KDA decode step of one layer as one op, and a prefill chunk of each sequence as one op (`kda.cpp`)."""

from __future__ import annotations

import math

import torch

from .kernels import ops, register_fakes, usable

FAMILY = "kda"


def can(*tensors) -> bool:
    return usable(FAMILY, *tensors)


def kda_decode(mixed, f, b, gate, conv_w, dt_bias, A_log, lower_bound, norm_w, eps: float, conv_state, rec_state,
               slots, fresh):
    """mixed [T, 3C] (the q/k/v projections before the conv), f [T, C] (f_b's output, before dt_bias),
    b [T, H] (beta's logits), gate [T, C] (the output gate's logits); conv_w [3C, K]; the cache's conv
    state [S, 3C, K-1] and recurrent state [S, H, dk, dv], both updated in place in `slots` [T]
    (a `fresh` [T] slot reads as zero first). lower_bound None: the softplus gate. Returns the normed
    output [T, H, dv] (the output norm's, flattened for o_proj)."""
    lb = math.nan if lower_bound is None else float(lower_bound)
    out = ops(FAMILY).kda_decode(mixed, f, b, gate, conv_w, dt_bias, A_log, lb, norm_w, eps,
                                 conv_state, rec_state, slots, fresh)
    return out.view(out.shape[0], A_log.shape[0], -1)     # [T, H, dv], as the output norm module gives it


def kda_prefill(mixed, f, b, gate, conv_w, dt_bias, A_log, lower_bound, norm_w, eps: float, conv_state, rec_state,
                slots, fresh, starts):
    """`kda_decode` over sequences of several new tokens: sequence n's rows are starts[n] ..
    starts[n+1] (`starts` [N+1], from 0 to T), its state slot slots[n], read as zero first where
    fresh[n]. Each (sequence, head) runs its tokens in order, the eager recurrent step's order;
    the state and conv window end updated in place. Returns [T, H, dv] as `kda_decode`."""
    lb = math.nan if lower_bound is None else float(lower_bound)
    out = ops(FAMILY).kda_prefill(mixed, f, b, gate, conv_w, dt_bias, A_log, lb, norm_w, eps,
                                  conv_state, rec_state, slots, fresh, starts)
    return out.view(out.shape[0], A_log.shape[0], -1)


@register_fakes(FAMILY)
def _fakes():
    torch.library.register_fake("ouro_native::kda_decode")(
        lambda mixed, f, b, gate, *rest: f.new_empty(f.shape))
    torch.library.register_fake("ouro_native::kda_prefill")(
        lambda mixed, f, b, gate, *rest: f.new_empty(f.shape))
