"""Manifold-constrained hyper-connection weights: pre / post / comb from the flattened streams."""

import torch


def sinkhorn(comb, iters: int, eps: float):
    """Alternately normalise columns and rows of comb [..., n, n] towards a doubly-stochastic matrix
    (columns first, `iters` column passes and `iters - 1` row passes, as the checkpoint was trained)."""
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb


def hc_weights(streams, fn, base, scale, norm_eps: float, hc_eps: float, iters: int):
    """streams: [T, n, D]. fn: [(2+n)*n, n*D], base: [(2+n)*n], scale: [3].
    Returns (pre [T, n], post [T, n], comb [T, n, n]) in float32."""
    n = streams.shape[1]
    flat = streams.reshape(streams.shape[0], -1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    mixed = flat @ fn.float().T
    pre_w, post_w, comb_w = mixed.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax((comb_w * scale[2] + comb_b).view(-1, n, n), dim=-1) + hc_eps
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
