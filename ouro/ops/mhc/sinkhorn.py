"""Manifold-constrained hyper-connection weights: pre / post / comb from the flattened streams."""

import torch

from .. import batch_invariant


def sinkhorn(comb, iters: int, eps: float):
    """Alternately normalise columns and rows of comb [..., n, n] towards a doubly-stochastic matrix
    (columns first, `iters` column passes and `iters - 1` row passes, as the checkpoint was trained):
    each pass divides by (sum + eps).

    The matrices are laid out batch-last, [n, n, T], so every sum adds n contiguous vectors of T
    (the [T, n, n] layout reduces over strides of 1 or n, which this CPU ran 6x slower at T = 2048:
    4.1 against 0.67 ms). The matrix sits in an (n+1) x (n+1) frame whose extra row and column hold
    eps, so a sum over the frame's n+1 rows is already `sum + eps` and each pass is two ops, the
    division in place (the decode step runs 39 passes per hyper-connection, twice per layer, on a
    few matrices: there dispatch, not arithmetic, is the cost).

    Under `batch_invariant` the sums are the last entries of a cumulative sum: a fixed order,
    whatever the batch (torch's sum over a short strided axis changes its grouping with T; the
    cumsum form costs 1.3x at decode and 2.6x at T = 2048 here, so it is not the default)."""
    n = comb.shape[-1]
    flat = comb.reshape(-1, n, n)
    frame = comb.new_full((n + 1, n + 1, flat.shape[0]), eps)
    m = frame[:n, :n]
    m.copy_(flat.permute(1, 2, 0))
    down, across = frame[:, :n], frame[:n, :]     # n+1 rows / n+1 columns (eps last)
    if batch_invariant.enabled():
        def col_sums():
            return down.cumsum(0)[n:]

        def row_sums():
            return across.cumsum(1)[:, n:]
    else:
        def col_sums():
            return down.sum(0, keepdim=True)

        def row_sums():
            return across.sum(1, keepdim=True)
    m.div_(col_sums())
    for _ in range(iters - 1):
        m.div_(row_sums())
        m.div_(col_sums())
    return m.permute(2, 0, 1).contiguous().view(comb.shape)


def hc_weights(streams, fn, base, scale, norm_eps: float, hc_eps: float, iters: int):
    """streams: [T, n, D]. fn: [(2+n)*n, n*D], base: [(2+n)*n], scale: [3].
    Returns (pre [T, n], post [T, n], comb [T, n, n]) in float32.

    The RMS normalisation is a per-row scalar, so it is applied to the [T, (2+n)*n] product
    rather than to the [T, n*D] streams (one pass over the streams fewer), and the three groups'
    scales and biases are one multiply-add over the product."""
    T, n = streams.shape[0], streams.shape[1]
    flat = streams.reshape(T, -1).float()
    inv_rms = torch.rsqrt(torch.linalg.vector_norm(flat, dim=-1, keepdim=True).square_() / flat.shape[1] + norm_eps)
    scale = scale.float()
    per_column = torch.cat([scale[:1].expand(n), scale[1:2].expand(n), scale[2:].expand(n * n)])
    z = torch.addcmul(base.float(), flat @ fn.float().T, inv_rms * per_column)
    gates = torch.sigmoid(z[:, :2 * n])
    pre = gates[:, :n] + hc_eps
    post = 2 * gates[:, n:]
    comb = torch.softmax(z[:, 2 * n:].view(T, n, n), dim=-1) + hc_eps
    return pre, post, sinkhorn(comb, iters, hc_eps)


def sinkhorn_naive(comb, iters: int, eps: float):
    """Reference with explicit loops over one [n, n] matrix."""
    m = [[float(x) for x in row] for row in comb]
    n = len(m)

    def cols():
        for j in range(n):
            s = sum(m[i][j] for i in range(n)) + eps
            for i in range(n):
                m[i][j] /= s

    def rows():
        for i in range(n):
            s = sum(m[i]) + eps
            m[i] = [x / s for x in m[i]]
    cols()
    for _ in range(iters - 1):
        rows()
        cols()
    return torch.tensor(m)
