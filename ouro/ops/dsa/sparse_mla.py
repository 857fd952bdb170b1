"""Sparse MLA over the latent cache, in the latent space.

The key/value up-projection (`kv_b_proj`) is absorbed: queries are mapped into the latent space
(q . W_uk), attention runs against the cached latents of the selected tokens only, and the
attended latent is mapped out through W_uv. No per-head K/V is ever expanded over the context.
"""

import torch


def absorb_weights(kv_b_weight, n_heads: int, qk_dim: int, v_dim: int):
    """kv_b_proj weight [H*(qk+v), r] -> (W_uk [H, qk, r], W_uv [H, v, r])."""
    w = kv_b_weight.view(n_heads, qk_dim + v_dim, -1)
    return w[:, :qk_dim], w[:, qk_dim:]


def absorb_queries(q_nope, w_uk, w_uv, scale: float):
    """(compute dtype, queries in the latent space scaled once, W_uv in the compute dtype). Latents
    are widened after their gather: `latents` may be the whole cache."""
    cdt = torch.promote_types(q_nope.dtype, torch.float32)
    return cdt, torch.einsum("nhd,hdr->nhr", q_nope.to(cdt), w_uk.to(cdt)) * scale, w_uv.to(cdt)


def sparse_mla(q_nope, latents, selected, w_uk, w_uv, scale: float, block: int = 256):
    """q_nope: [n, H, qk]; latents: [L, r] the sequence's cached latents; selected: [n, W] token
    indices (-1 = unused) or None for causal-dense (query i at position L-n+i sees 0..L-n+i).
    Returns [n, H, v] in q_nope's dtype; scores, softmax and the weighted sum run in float32 at
    least (16-bit inputs are widened, as flash-attention kernels accumulate)."""
    n = q_nope.shape[0]
    cdt, q_lat, w_uv = absorb_queries(q_nope, w_uk, w_uv, scale)
    L = latents.shape[0]
    if n <= block:   # one block: no loop (a traced graph keeps the row count symbolic)
        return _attend(q_lat, latents, selected, w_uv, 0, n, L, cdt).to(q_nope.dtype)
    out = q_nope.new_full((n, w_uv.shape[0], w_uv.shape[1]), float("nan"))
    for s in range(0, n, block):  # bound the [block, H, W] score tensor
        e = min(n, s + block)
        out[s:e] = _attend(q_lat[s:e], latents, None if selected is None else selected[s:e], w_uv, s, n, L, cdt)
    return out


# A block of prefill queries whose context is at most this many times the selection's width
# attends through one masked product over the context (each latent row read once for the block,
# a GEMM) rather than a gather of every query's own rows: the scores it computes and then masks
# are no more than MASKED_WIDTHS x the selected ones.
MASKED_WIDTHS = 4


# Queries per block of a prefill chunk: smaller blocks mask less of a causal block's own future and
# keep a gathered block's [block, W, r] rows in cache. Measured on `small` (2 threads, AVX2): an
# 8,192-token prompt's chunks spent 1,589 ms here at 256 queries a block, 769 at 64, 645 at 32 and
# 646 at 64 in a second pair (the prefill 6.09 -> 5.57 s); 16 x 512 prompts the same at 256 and 64.
CHUNK_BLOCK = 64


def sparse_mla_chunk(q_nope, latents, selected, w_uk, w_uv, scale: float, block: int = CHUNK_BLOCK):
    """A prefill chunk of one sequence: q_nope [n, H, qk]; latents [L, r] the sequence's cached
    latents (token t at row t); selected [n, W] token positions (-1 unused), each row's tokens at
    or before its query. Returns [n, H, v] as `sparse_mla` with those rows: per block of queries,
    over the context the block can see, a masked dense product where that context is short
    (`MASKED_WIDTHS`), else the gathered rows."""
    n, W = selected.shape
    cdt, q_lat, w_uv = absorb_queries(q_nope, w_uk, w_uv, scale)
    out = q_nope.new_full((n, w_uv.shape[0], w_uv.shape[1]), float("nan"))
    for s in range(0, n, block):
        e = min(n, s + block)
        sel = selected[s:e]
        seen = int(sel.max()) + 1 if sel.numel() else 0        # the block's context (one host read)
        if seen <= MASKED_WIDTHS * W:
            dense = latents[:seen].to(cdt)
            keep = torch.zeros(e - s, seen + 1, dtype=torch.bool, device=sel.device)
            keep.scatter_(1, sel.masked_fill(sel < 0, seen), True)          # unused entries: the spare column
            scores = torch.einsum("nhr,lr->nhl", q_lat[s:e], dense)
            probs = scores.masked_fill(~keep[:, None, :seen], float("-inf")).softmax(-1)
            o_lat = torch.einsum("nhl,lr->nhr", probs, dense)
            out[s:e] = torch.einsum("nhr,hvr->nhv", o_lat, w_uv).to(out.dtype)
        else:
            out[s:e] = _attend(q_lat[s:e], latents, sel, w_uv, s, n, latents.shape[0], cdt).to(out.dtype)
    return out


def _attend(q_lat, latents, selected, w_uv, s, n, L, cdt):
    """Rows s .. s + len(q_lat) of the n queries, against the dense causal prefix or their selection."""
    e = s + q_lat.shape[0]
    if selected is None:
        dense = latents.to(cdt)
        scores = torch.einsum("nhr,lr->nhl", q_lat, dense)
        pos = torch.arange(L - n + s, L - n + e, device=latents.device)
        mask = torch.arange(L, device=latents.device)[None, :] <= pos[:, None]
        probs = scores.masked_fill(~mask[:, None, :], float("-inf")).softmax(-1)
        o_lat = torch.einsum("nhl,lr->nhr", probs, dense)
    else:
        kv = latents[selected.clamp(min=0)].to(cdt)                          # [b, W, r]
        scores = torch.einsum("nhr,nwr->nhw", q_lat, kv)
        probs = scores.masked_fill((selected < 0)[:, None, :], float("-inf")).softmax(-1)
        o_lat = torch.einsum("nhw,nwr->nhr", probs, kv)
    return torch.einsum("nhr,hvr->nhv", o_lat, w_uv)


def sparse_mla_naive(q_nope, latents, selected, kv_b_weight, scale: float):
    """Reference: expand K and V for every context token and head, dense mask from the selection."""
    n, H, qk = q_nope.shape
    L = latents.shape[0]
    kv = (latents @ kv_b_weight.T).view(L, H, -1)
    k, v = kv[..., :qk], kv[..., qk:]
    mask = torch.zeros(n, L, dtype=torch.bool)
    for i in range(n):
        for t in selected[i].tolist():
            if t >= 0:
                mask[i, t] = True
    scores = torch.einsum("nhd,lhd->nhl", q_nope, k) * scale
    probs = scores.masked_fill(~mask[:, None, :], float("-inf")).softmax(-1)
    return torch.einsum("nhl,lhv->nhv", probs, v)
