"""mHC kernels: Sinkhorn normalisation (batched vs the per-matrix loop) and hyper-connection weights."""

import pytest
import torch

from ouro.ops.mhc import hc_weights, sinkhorn, sinkhorn_naive


from tests.helpers.numerics import assert_close, rel_rms  # noqa: F401


def assert_doubly_stochastic(m, tol=1e-3):
    assert not torch.isnan(m).any()
    assert (m > 0).all()
    rows, cols = m.sum(-1), m.sum(-2)
    assert (rows - 1).abs().max() <= tol, f"row sums off by {(rows - 1).abs().max():.2e}"
    assert (cols - 1).abs().max() <= tol, f"column sums off by {(cols - 1).abs().max():.2e}"


@pytest.mark.parametrize("n", [2, 4, 6])
@pytest.mark.parametrize("eps", [1e-6, 0.0])
def test_sinkhorn_doubly_stochastic_and_matches_naive(n, eps):
    gen = torch.Generator().manual_seed(n)
    # random positive matrices, entries spread over about a decade
    comb = torch.rand(8, n, n, generator=gen) * 10 + 0.5
    out = sinkhorn(comb, 20, eps)
    assert out.shape == comb.shape
    assert_doubly_stochastic(out)
    for i in range(comb.shape[0]):
        assert_close(out[i], sinkhorn_naive(comb[i], 20, eps))


@pytest.mark.parametrize("rows", [1, 16, 256, 257, 600])
def test_sinkhorn_batch_last_layout_matches_naive(rows):
    """The batch-last framed form equals the per-matrix loop at every batch size, and returns a
    contiguous [T, n, n] tensor."""
    gen = torch.Generator().manual_seed(rows)
    comb = torch.softmax(torch.randn(rows, 4, 4, generator=gen) * 2, -1) + 1e-6
    out = sinkhorn(comb, 20, 1e-6)
    assert out.shape == comb.shape and out.is_contiguous()
    for i in range(0, rows, max(1, rows // 7)):
        assert_close(out[i], sinkhorn_naive(comb[i], 20, 1e-6))
    assert_close(sinkhorn(comb.double(), 20, 1e-6).float(), out)


def test_sinkhorn_badly_scaled_matches_naive():
    """Near-permutation matrices (entries over ~3 decades) converge slowly: 20 iterations leave the
    rows a few 1e-3 off, which is the trained behaviour. Only the last (column) pass is exact, and the
    batched op must still equal the loop."""
    gen = torch.Generator().manual_seed(5)
    comb = torch.exp(torch.randn(6, 4, 4, generator=gen) * 2)
    out = sinkhorn(comb, 20, 1e-6)
    assert torch.allclose(out.sum(-2), torch.ones(6, 4), atol=1e-5)
    for i in range(comb.shape[0]):
        assert_close(out[i], sinkhorn_naive(comb[i], 20, 1e-6))


@pytest.mark.parametrize("iters", [1, 2, 5])
def test_sinkhorn_iteration_count_matches_naive(iters):
    """Column pass first, iters column and iters-1 row passes: after one iteration only the columns
    are normalised."""
    gen = torch.Generator().manual_seed(iters)
    comb = torch.rand(3, 4, 4, generator=gen) + 0.05
    out = sinkhorn(comb, iters, 1e-6)
    for i in range(3):
        assert_close(out[i], sinkhorn_naive(comb[i], iters, 1e-6))
    assert torch.allclose(out.sum(-2), torch.ones(3, 4), atol=1e-5)  # last pass is always columns
    if iters == 1:
        assert not torch.allclose(out.sum(-1), torch.ones(3, 4), atol=1e-2)


def test_sinkhorn_leading_dims():
    gen = torch.Generator().manual_seed(0)
    comb = torch.rand(2, 3, 4, 4, generator=gen) + 0.1
    out = sinkhorn(comb, 20, 1e-6)
    assert_doubly_stochastic(out)
    assert_close(out, sinkhorn(comb.view(6, 4, 4), 20, 1e-6).view(2, 3, 4, 4))


@pytest.mark.parametrize("T,n,D", [(5, 4, 16), (1, 4, 8), (3, 2, 12)])
def test_hc_weights(T, n, D):
    gen = torch.Generator().manual_seed(T * 10 + n)
    hc_eps = 1e-6
    streams = torch.randn(T, n, D, generator=gen) * 3
    fn = torch.randn((2 + n) * n, n * D, generator=gen) * (n * D) ** -0.5
    base = torch.randn((2 + n) * n, generator=gen)
    scale = torch.tensor([1.0, 2.0, 0.5])  # moderate comb logits: 20 Sinkhorn iterations converge
    pre, post, comb = hc_weights(streams, fn, base, scale, 1e-6, hc_eps, 20)
    assert pre.shape == (T, n) and post.shape == (T, n) and comb.shape == (T, n, n)
    assert pre.dtype == post.dtype == comb.dtype == torch.float32
    for x in (pre, post, comb):
        assert not torch.isnan(x).any()
    assert (pre > 0).all() and (pre <= 1 + hc_eps).all()
    assert (post > 0).all() and (post < 2).all()
    assert_doubly_stochastic(comb)

    # recompute by hand: RMS-normalised flat streams, linear map, sigmoid / 2*sigmoid / softmax + Sinkhorn
    flat = streams.reshape(T, -1)
    flat = flat / flat.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    mixed = flat @ fn.T
    pre_ref = torch.sigmoid(mixed[:, :n] * scale[0] + base[:n]) + hc_eps
    post_ref = 2 * torch.sigmoid(mixed[:, n:2 * n] * scale[1] + base[n:2 * n])
    logits = (mixed[:, 2 * n:] * scale[2] + base[2 * n:]).view(T, n, n)
    comb_ref = torch.stack([sinkhorn_naive(torch.softmax(l, -1) + hc_eps, 20, hc_eps) for l in logits])
    assert_close(pre, pre_ref)
    assert_close(post, post_ref)
    assert_close(comb, comb_ref)


def test_hc_weights_scale_invariant_in_streams():
    """The streams are RMS-normalised first: scaling them changes nothing."""
    gen = torch.Generator().manual_seed(1)
    T, n, D = 3, 4, 8
    streams = torch.randn(T, n, D, generator=gen)
    fn = torch.randn((2 + n) * n, n * D, generator=gen) * 0.2
    base = torch.randn((2 + n) * n, generator=gen)
    scale = torch.tensor([1.0, 1.0, 1.0])
    a = hc_weights(streams, fn, base, scale, 1e-6, 1e-6, 20)
    b = hc_weights(streams * 100, fn, base, scale, 1e-6, 1e-6, 20)
    for x, y in zip(a, b):
        assert_close(x, y)
