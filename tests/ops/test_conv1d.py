"""Depthwise causal conv with a carried window: fast (F.conv1d + gather) against the tap-by-tap loop."""

import pytest
import torch

from ouro.ops.conv1d import causal_conv1d, causal_conv1d_naive


from tests.helpers.numerics import assert_close, rel_rms  # noqa: F401


CASES = [  # (K, T, lengths)
    (4, 10, [10, 7, 2, 1]),   # full, partial, shorter than K-1, a single token
    (4, 1, [1, 1]),           # decode: T = 1
    (4, 3, [3, 2, 1]),        # every length < K-1 or == K-1
    (2, 6, [6, 1, 3]),        # K-1 = 1
    (5, 9, [9, 4, 3, 8, 1]),  # length == K-1 and < K-1 with a wider kernel
    (4, 5, [5, 0]),           # a sequence with no new tokens keeps its state
]


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh", "carried"])
@pytest.mark.parametrize("K,T,lengths", CASES, ids=[f"K{c[0]}-T{c[1]}-{'_'.join(map(str, c[2]))}" for c in CASES])
def test_conv_matches_naive(K, T, lengths, fresh):
    gen = torch.Generator().manual_seed(K * 1000 + T * 10 + len(lengths))
    B, C = len(lengths), 6
    x = torch.randn(B, C, T, generator=gen)
    lens = torch.tensor(lengths)
    for b, n in enumerate(lengths):  # padding holds garbage, it must not leak anywhere
        x[b, :, n:] = 1e3
    weight = torch.randn(C, K, generator=gen)
    state = torch.zeros(B, C, K - 1) if fresh else torch.randn(B, C, K - 1, generator=gen)
    state_copy = state.clone()

    out, new_state = causal_conv1d(x, weight, state, lens)
    out_ref, state_ref = causal_conv1d_naive(x, weight, state, lens)
    assert out.shape == (B, C, T)
    assert new_state.shape == (B, C, K - 1)
    assert torch.equal(state, state_copy), "causal_conv1d modified the caller's conv_state"

    valid = torch.arange(T)[None, :] < lens[:, None]                 # [B, T]
    if valid.any():
        a = out.transpose(1, 2)[valid]                               # [n_valid, C]
        b = out_ref.transpose(1, 2)[valid]
        assert_close(a, b)
    assert_close(new_state, state_ref)
    # the new state is exactly the last K-1 real inputs (no arithmetic involved)
    for b, n in enumerate(lengths):
        seq = torch.cat([state[b], x[b, :, :n]], dim=-1)
        assert torch.equal(new_state[b], seq[:, seq.shape[-1] - (K - 1):])


def test_chunked_prefill_equals_one_pass():
    """Feeding a sequence in pieces, carrying the state, equals one pass over the whole sequence."""
    gen = torch.Generator().manual_seed(3)
    C, K, T = 5, 4, 11
    x = torch.randn(1, C, T, generator=gen)
    weight = torch.randn(C, K, generator=gen)
    full, full_state = causal_conv1d(x, weight, torch.zeros(1, C, K - 1), torch.tensor([T]))
    state, outs = torch.zeros(1, C, K - 1), []
    for s, e in [(0, 2), (2, 3), (3, 9), (9, 11)]:
        o, state = causal_conv1d(x[..., s:e], weight, state, torch.tensor([e - s]))
        outs.append(o)
    assert_close(torch.cat(outs, dim=-1), full)
    assert_close(state, full_state)


def test_float32_kernel_convolves_bfloat16_input_in_float32():
    """Checkpoints keep the conv kernel in fp32: bf16 inputs are convolved in fp32, not rounded twice."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 5, generator=gen).bfloat16()
    weight, state = torch.randn(6, 4, generator=gen), torch.randn(2, 6, 3, generator=gen)
    lens = torch.tensor([5, 3])
    for t in (x, x[..., :1]):  # prefill and the decode fast path
        out, new_state = causal_conv1d(t, weight, state, lens.clamp(max=t.shape[-1]))
        ref, ref_state = causal_conv1d(t.float(), weight, state, lens.clamp(max=t.shape[-1]))
        assert out.dtype == torch.float32 and torch.equal(out, ref) and torch.equal(new_state, ref_state)


def test_a_few_tokens_round_as_decode_steps_do():
    """Up to SHORT new tokens, each output is decode's K-tap product over the same window: the
    same bits as feeding the tokens one decode step at a time (a speculative verification's conv
    then matches the plain decode run's exactly)."""
    from ouro.ops.conv1d import SHORT
    g = torch.Generator().manual_seed(5)
    C, K, T = 24, 4, SHORT
    x, weight = torch.randn(2, C, T, generator=g), torch.randn(C, K, generator=g)
    state = torch.randn(2, C, K - 1, generator=g)
    out, _ = causal_conv1d(x, weight, state, torch.tensor([T, T]))
    window = state
    for t in range(T):
        step, window = causal_conv1d(x[:, :, t:t + 1], weight, window, torch.tensor([1, 1]))
        assert torch.equal(out[:, :, t:t + 1], step)
