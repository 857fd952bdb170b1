"""Depthwise causal short convolution with a carried window (the KDA q/k/v conv)."""

import torch
import torch.nn.functional as F

from . import batch_invariant

SHORT = 8     # up to this many new tokens the conv is decode's K-tap product at each position (same rounding)


def causal_conv1d(x, weight, conv_state, lengths):
    """x: [B, C, T] new inputs, right-padded per sequence to T; weight: [C, K];
    conv_state: [B, C, K-1] the previous K-1 inputs (zeros for a fresh sequence);
    lengths: [B] real token counts (<= T).
    Returns (out [B, C, T] before activation, new_state [B, C, K-1]: the last K-1 real inputs).
    Computed in the wider of x's and weight's dtypes: a float32 kernel (as checkpoints keep it)
    convolves bfloat16 inputs in float32."""
    K = weight.shape[-1]
    dt = torch.promote_types(x.dtype, weight.dtype)
    full = torch.cat([conv_state.to(dt), x.to(dt)], dim=-1)               # [B, C, K-1+T]
    if batch_invariant.enabled():   # one summation order for every length: tap by tap
        T = x.shape[-1]
        w = weight.to(dt)
        out = full[..., :T] * w[:, :1]
        for j in range(1, K):
            out = out + full[..., j:j + T] * w[:, j:j + 1]
    elif x.shape[-1] == 1:  # decode: one output per channel, a K-tap dot product (far cheaper than conv1d)
        out = (full * weight.to(dt)).sum(-1, keepdim=True)
    elif x.shape[-1] <= SHORT:   # a few tokens (a speculative verification): decode's dot product per position
        out = (full.unfold(-1, K, 1) * weight.to(dt).unsqueeze(1)).sum(-1)
    else:
        out = F.conv1d(full, weight.to(dt).unsqueeze(1), groups=x.shape[1])
    return out, last_columns(full, lengths, K - 1)


def last_columns(full, lengths, n: int):
    """full: [B, C, n+T] = a window of n then right-padded inputs; the last n real columns of
    each row. Input i sits at column n+i, so they start at column lengths[b]."""
    idx = lengths.view(-1, 1, 1) + torch.arange(n, device=full.device).view(1, 1, -1)
    return full.gather(-1, idx.expand(-1, full.shape[1], -1))


def last_inputs(window, x, lengths):
    """The last K-1 inputs of [window | x[b, :, :lengths[b]]] per row: the window the next token
    sees. window: [B, C, K-1]; x: [B, C, T] right-padded."""
    dt = torch.promote_types(x.dtype, window.dtype)
    return last_columns(torch.cat([window.to(dt), x.to(dt)], dim=-1), lengths, window.shape[-1])


def causal_conv1d_naive(x, weight, conv_state, lengths):
    """Reference: explicit sum over kernel taps, one sequence at a time."""
    B, C, T = x.shape
    K = weight.shape[-1]
    out = torch.full((B, C, T), float("nan"))
    states = []
    for b in range(B):
        seq = torch.cat([conv_state[b], x[b, :, : int(lengths[b])]], dim=-1)
        for t in range(int(lengths[b])):
            out[b, :, t] = sum(weight[:, j] * seq[:, t + j] for j in range(K))
        states.append(seq[:, seq.shape[-1] - (K - 1):])
    return out, torch.stack(states)
