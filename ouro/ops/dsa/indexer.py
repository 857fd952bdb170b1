"""Lightning indexer with k-pool compression: which cached tokens each query may attend to.

Keys are grouped in pools of `kpool` consecutive tokens (pool p = tokens [p*kpool, (p+1)*kpool)),
each compressed to one key by a per-channel softmax gate. A query at position `pos` sees the
`(pos+1) // kpool` complete pools before it; it keeps the `select_k` best-scoring ones and always
appends the raw tokens of its incomplete tail pool. Ties are broken towards the earlier pool, so a
selection never depends on how a batch was cut.
"""

import torch


def pool_keys(keys, gate_scores, ape):
    """keys, gate_scores: [P*kpool, d] for complete pools; ape: [kpool, d].
    Returns the compressed pool keys [P, d]."""
    kpool, d = ape.shape
    k = keys.float().view(-1, kpool, d)
    w = (gate_scores.float().view(-1, kpool, d) + ape.float()).softmax(dim=1)
    return (w * k).sum(dim=1)


def stable_topk_mask(scores, k: int):
    """Boolean mask of the k largest entries per row; among equal values the lowest index wins."""
    kth = scores.topk(k, dim=-1).values[..., -1:]
    above = scores > kth
    tied = scores == kth
    room = k - above.sum(-1, keepdim=True)
    return above | (tied & (tied.cumsum(-1) <= room))


SCORE_BUDGET = 1 << 25  # floats of per-head scores held at once (128 MiB): long contexts go in row blocks


def index_select(q, weights, pooled, positions, select_k: int, kpool: int, scale: float, width: int):
    """q: [n, Hi, d] indexer queries, weights: [n, Hi] per-head weights, pooled: the context's pool
    keys, [P, d] shared by all queries (one sequence) or [n, P, d] per query (a decode batch, rows
    right-padded: a query sees only its first (pos+1)//kpool pools), positions: [n] absolute
    positions of the queries. Returns [n, width] int64 token indices, -1 where unused."""
    n, Hi = q.shape[0], q.shape[1]
    block = max(1, SCORE_BUDGET // max(1, Hi * pooled.shape[-2]))
    if n > block:  # bound the [rows, Hi, P] score tensor
        return torch.cat([index_select(q[s:s + block], weights[s:s + block],
                                       pooled if pooled.dim() == 2 else pooled[s:s + block],
                                       positions[s:s + block], select_k, kpool, scale, width)
                          for s in range(0, n, block)])
    P = pooled.shape[-2]
    dev = q.device
    n_vis = torch.div(positions + 1, kpool, rounding_mode="floor")                 # complete pools seen
    out = torch.full((n, width), -1, dtype=torch.long, device=dev)
    if P > 0:
        pool_ids = torch.arange(P, device=dev)
        visible = pool_ids[None, :] < n_vis[:, None]
        if P <= select_k:
            chosen = visible
        else:
            spec = "nhd,pd->nhp" if pooled.dim() == 2 else "nhd,npd->nhp"
            s = torch.relu(torch.einsum(spec, q.float(), pooled) * scale)
            s = torch.einsum("nh,nhp->np", weights.float(), s).masked_fill(~visible, float("-inf"))
            chosen = stable_topk_mask(s, select_k) & visible
        # compact the chosen pool ids to the front of each row, in pool order
        slot = chosen.long().cumsum(-1) - 1
        n_sel = min(P, select_k)
        pools = torch.full((n, n_sel + 1), -1, dtype=torch.long, device=dev)
        pools.scatter_(1, torch.where(chosen, slot, n_sel), pool_ids.expand(n, -1))
        pools = pools[:, :n_sel]
        tok = pools[..., None] * kpool + torch.arange(kpool, device=dev)
        tok = tok.masked_fill(pools[..., None] < 0, -1).flatten(1)
        out[:, : tok.shape[1]] = tok
    # the incomplete tail pool: tokens n_vis*kpool .. pos, always in the last kpool-1 columns, so a
    # row's layout (and the attention's summation order over it) does not depend on the pools
    # padded in for the longest context of its batch
    tail = n_vis[:, None] * kpool + torch.arange(kpool - 1, device=dev)
    tail = tail.masked_fill(tail > positions[:, None], -1)
    out[:, width - (kpool - 1):] = tail
    return out


def index_select_naive(q, weights, keys, gate_scores, ape, positions, select_k, kpool, scale):
    """Reference, one query at a time with plain Python selection. keys/gate_scores: [L, d] for the
    whole context. Returns a list of sorted token-index lists."""
    result = []
    for i in range(q.shape[0]):
        pos = int(positions[i])
        n_vis = (pos + 1) // kpool
        scored = []
        for p in range(n_vis):
            sl = slice(p * kpool, (p + 1) * kpool)
            w = (gate_scores[sl].float() + ape.float()).softmax(dim=0)
            pk = (w * keys[sl].float()).sum(0)
            s = sum(float(weights[i, h]) * max(float(q[i, h].float() @ pk) * scale, 0.0) for h in range(q.shape[1]))
            scored.append((s, p))
        kept = sorted(scored, key=lambda t: (-t[0], t[1]))[:select_k] if n_vis > select_k else scored
        toks = [p * kpool + j for _, p in kept for j in range(kpool)] + list(range(n_vis * kpool, pos + 1))
        result.append(sorted(toks))
    return result
