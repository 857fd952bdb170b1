"""KDA (gated delta rule) kernels: chunked prefill and single-step decode against the naive loop."""

import pytest
import torch

from ouro.ops.kda import kda_chunk, kda_naive, kda_recurrent_step


from tests.helpers.kda_inputs import make_inputs
from tests.helpers.numerics import assert_close, rel_rms  # noqa: F401


CASES = [  # (T, chunk_size)
    (64, 16), (64, 64),           # chunk divides T
    (50, 16), (50, 64), (50, 7),  # it does not (incl. C > T and an odd C)
    (1, 16), (1, 64), (1, 1),     # a single token
    (17, 1),                      # chunk of one token == recurrence
]


@pytest.mark.parametrize("with_state", [False, True], ids=["no_s0", "s0"])
@pytest.mark.parametrize("T,C", CASES, ids=[f"T{t}-C{c}" for t, c in CASES])
def test_chunk_matches_naive(T, C, with_state):
    B, H, dk, dv = 2, 3, 8, 12   # B > 1, several heads, dk != dv
    q, k, v, g, beta, s0 = make_inputs(B, T, H, dk, dv, seed=T * 100 + C, with_state=with_state)
    s0_copy = None if s0 is None else s0.clone()
    o_ref, s_ref = kda_naive(q, k, v, g, beta, s0)
    o, s = kda_chunk(q, k, v, g, beta, s0, chunk_size=C)
    assert o.shape == (B, T, H, dv) and s.shape == (B, H, dk, dv)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    # the op fills its output buffer with NaN first: any NaN is an unwritten row
    assert not torch.isnan(o).any(), "kda_chunk left output rows unwritten"
    assert_close(o, o_ref)
    assert_close(s, s_ref)
    if s0 is not None:
        assert torch.equal(s0, s0_copy), "kda_chunk modified the caller's initial_state"


def test_chunk_state_carries_across_calls():
    """Two consecutive prefill calls (the second starting from the first's final state) equal one call."""
    B, T, H, dk, dv = 2, 40, 2, 8, 6
    q, k, v, g, beta, _ = make_inputs(B, T, H, dk, dv, seed=7)
    o_ref, s_ref = kda_naive(q, k, v, g, beta)
    cut = 23
    o1, s1 = kda_chunk(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut], chunk_size=16)
    o2, s2 = kda_chunk(q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], beta[:, cut:], s1, chunk_size=16)
    assert_close(torch.cat([o1, o2], dim=1), o_ref)
    assert_close(s2, s_ref)


@pytest.mark.parametrize("C", [16, 64, 7])
@pytest.mark.parametrize("with_state", [False, True], ids=["no_s0", "s0"])
def test_right_padding_is_a_noop(C, with_state):
    """Per the chunk contract: right-padding a shorter sequence with g = 0, beta = 0 leaves its final
    state exact. Batch of two sequences of lengths 50 and 29, padded to 50."""
    B, T, H, dk, dv = 2, 50, 2, 8, 12
    lengths = [50, 29]
    q, k, v, g, beta, s0 = make_inputs(B, T, H, dk, dv, seed=11 + C, with_state=with_state)
    # garbage q/k/v in the padding (the contract only constrains g and beta)
    g, beta = g.clone(), beta.clone()
    for b, n in enumerate(lengths):
        g[b, n:] = 0.0
        beta[b, n:] = 0.0
    o, s = kda_chunk(q, k, v, g, beta, s0, chunk_size=C)
    assert not torch.isnan(o).any()
    for b, n in enumerate(lengths):
        sb = None if s0 is None else s0[b:b + 1]
        args = (x[b:b + 1, :n] for x in (q, k, v, g, beta))
        o_ref, s_ref = kda_naive(*args, sb)
        o_fast, s_fast = kda_chunk(*(x[b:b + 1, :n] for x in (q, k, v, g, beta)), sb, chunk_size=C)
        assert_close(s[b:b + 1], s_ref)          # padded batch == unpadded reference
        assert_close(s[b:b + 1], s_fast)         # padded batch == unpadded chunk run
        assert_close(o[b:b + 1, :n], o_ref)      # the real positions' outputs are unaffected


@pytest.mark.parametrize("with_state", [False, True], ids=["no_s0", "s0"])
def test_recurrent_step_matches_naive(with_state):
    B, T, H, dk, dv = 3, 20, 2, 8, 12
    q, k, v, g, beta, s0 = make_inputs(B, T, H, dk, dv, seed=5, with_state=with_state)
    o_ref, s_ref = kda_naive(q, k, v, g, beta, s0)
    state = torch.zeros(B, H, dk, dv) if s0 is None else s0.clone()
    ptr = state.data_ptr()
    outs = []
    for t in range(T):
        before = state.clone()
        o_t = kda_recurrent_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        assert o_t.shape == (B, H, dv)
        assert not torch.equal(state, before), "kda_recurrent_step did not update the state in place"
        outs.append(o_t)
    assert state.data_ptr() == ptr
    assert_close(torch.stack(outs, dim=1), o_ref)
    assert_close(state, s_ref)


def test_recurrent_step_continues_chunk_prefill():
    """Prefill with the chunked kernel, then decode with the recurrent step: equals the naive loop."""
    B, T, H, dk, dv = 2, 30, 2, 8, 6
    q, k, v, g, beta, _ = make_inputs(B, T, H, dk, dv, seed=9)
    o_ref, s_ref = kda_naive(q, k, v, g, beta)
    P = 25
    o_pre, state = kda_chunk(q[:, :P], k[:, :P], v[:, :P], g[:, :P], beta[:, :P], chunk_size=16)
    outs = [o_pre]
    for t in range(P, T):
        outs.append(kda_recurrent_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)[:, None])
    assert_close(torch.cat(outs, dim=1), o_ref)
    assert_close(state, s_ref)


def test_strong_decay_long_chunk_no_overflow():
    """Cumulative log-decay over a 64-token chunk reaches about -320: exp(-cumsum) would overflow
    float32; the pairwise-difference form must stay finite and exact."""
    B, T, H, dk, dv = 1, 64, 2, 8, 8
    q, k, v, _, beta, s0 = make_inputs(B, T, H, dk, dv, seed=13, with_state=True)
    g = torch.full((B, T, H, dk), -5.0)
    g[..., ::2] = -0.01  # mix of slow and fast channels
    o_ref, s_ref = kda_naive(q, k, v, g, beta, s0)
    o, s = kda_chunk(q, k, v, g, beta, s0, chunk_size=64)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert_close(o, o_ref)
    assert_close(s, s_ref)


@pytest.mark.parametrize("C", [16, 64])
def test_chunk_repeated_key_full_beta(C):
    """Stress the in-chunk triangular solve: the same key at every step, beta = 1, no decay (a
    repeated token). The delta rule then overwrites the memory each step."""
    B, T, H, dk, dv = 1, 96, 2, 8, 8
    q, k, v, _, _, _ = make_inputs(B, T, H, dk, dv, seed=21)
    k = k[:, :1].expand_as(k).contiguous()
    g = torch.zeros(B, T, H, dk)
    beta = torch.ones(B, T, H)
    o_ref, s_ref = kda_naive(q, k, v, g, beta)
    o, s = kda_chunk(q, k, v, g, beta, chunk_size=C)
    assert_close(o, o_ref)
    assert_close(s, s_ref)
    # with beta = 1 and a unit key, the memory recalls exactly the last value for that key
    recalled = torch.einsum("bhk,bhkv->bhv", k[:, -1], s)
    assert torch.allclose(recalled, v[:, -1], atol=1e-5)
