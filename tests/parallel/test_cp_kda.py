"""KCP across real processes (2 ranks, gloo on 127.0.0.1): each rank's slice of the output and the
last rank's state equal one unsplit run, for aligned and mid-chunk cuts, several sequences and a
nonzero initial state; a failing rank is reported, not waited on."""

import pytest
import torch

from ouro.ops.kda import kda_chunk
from ouro.ops.conv1d import causal_conv1d
from ouro.parallel.cp_kda import conv_halo, kda_context_parallel
from ouro.parallel.groups import launch

from tests.helpers.numerics import rel_rms
from tests.helpers.kda_inputs import make_inputs

CASES = [(64, 32, False), (50, 23, False), (50, 23, True), (40, 16, True)]   # (T, cut, initial state)


def inputs(T, with_state, seed):
    return make_inputs(3, T, 2, 8, 12, seed=seed, with_state=with_state)


def rank_work(groups, cases, precision):
    out = []
    for i, (T, cut, with_state) in enumerate(cases):
        q, k, v, g, beta, s0 = inputs(T, with_state, seed=i)
        s = slice(0, cut) if groups.cp_rank == 0 else slice(cut, T)
        o, state = kda_context_parallel(*(t[:, s] for t in (q, k, v, g, beta)), s0, groups.cp, 16, precision)
        out.append((o, state))
    return out


@pytest.mark.processes
def test_two_ranks_equal_one_run():
    results = launch(rank_work, 2, CASES, "fp32")
    for i, (T, cut, with_state) in enumerate(CASES):
        q, k, v, g, beta, s0 = inputs(T, with_state, seed=i)
        o_ref, s_ref = kda_chunk(q, k, v, g, beta, s0, 16)
        o = torch.cat([results[0][i][0], results[1][i][0]], dim=1)
        assert o.shape == o_ref.shape and not torch.isnan(o).any()
        assert rel_rms(o, o_ref) < 1e-5, (i, rel_rms(o, o_ref))
        assert rel_rms(results[1][i][1], s_ref) < 1e-5


def fails_on_rank_1(groups):
    if groups.rank == 1:
        raise ValueError("planted")
    torch.distributed.barrier(group=groups.cp)     # rank 0 would wait here for ever
    return 0


@pytest.mark.processes
def test_a_failing_rank_is_reported_and_nothing_hangs():
    with pytest.raises(RuntimeError, match="rank 1 of 2 failed: ValueError: planted"):
        launch(fails_on_rank_1, 2, timeout_s=60)


def dies_on_rank_1(groups):
    if groups.rank == 1:
        import os
        os._exit(3)                                  # killed mid-work: no result, no error message
    torch.distributed.barrier(group=groups.cp)
    return 0


@pytest.mark.processes
def test_a_rank_that_dies_is_reported_and_nothing_hangs():
    with pytest.raises(RuntimeError, match="rank 1 of 2 died \\(exit code 3\\) without a result"):
        launch(dies_on_rank_1, 2, timeout_s=60)


def halo_work(groups, cuts, T, K):
    g = torch.Generator().manual_seed(T)
    x = torch.randn(2, 6, T, generator=g)
    state = torch.randn(2, 6, K - 1, generator=g)
    w = torch.randn(6, K, generator=g)
    bounds = [0, *cuts, T]
    s = slice(bounds[groups.cp_rank], bounds[groups.cp_rank + 1])
    lengths = torch.full((2,), s.stop - s.start)
    window = conv_halo(x[..., s], state, lengths, groups.cp)
    out, _ = causal_conv1d(x[..., s], w, window, lengths)
    return out


@pytest.mark.processes
@pytest.mark.parametrize("cuts", [(9, 20), (9, 10)], ids=["long-slices", "a-slice-shorter-than-the-halo"])
def test_conv_halo_gives_the_unsplit_convolution(cuts):
    """3 ranks: each convolves its slice from the window the halo exchange builds; together they
    equal one convolution of the whole prompt, also when a slice is shorter than K - 1."""
    T, K = 30, 4
    outs = launch(halo_work, 3, cuts, T, K)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(2, 6, T, generator=g)
    state = torch.randn(2, 6, K - 1, generator=g)
    w = torch.randn(6, K, generator=g)
    ref, _ = causal_conv1d(x, w, state, torch.full((2,), T))
    assert rel_rms(torch.cat(outs, dim=-1), ref) < 1e-6
