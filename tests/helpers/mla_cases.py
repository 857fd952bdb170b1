"""The native MLA tests' cases: paged latent caches and pool keys with their decode and selection
inputs (`native/test_native_mla.py`, `native/test_native_bfloat16.py`)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ouro.layers.context import QuantisedRows
from ouro.layers.dsa import cache_rows
from ouro.ops.quant.kv_rows import row_bytes


class Paged:
    """B sequences of lengths `lens` over pages shuffled across a pool (never contiguous), one row of
    `width` per token; pages and rows nobody owns stay poisoned."""

    def __init__(self, lens, ps, gen, spare=3):
        self.lens, self.ps = lens, ps
        per = max(-(-L // ps) for L in lens) + spare           # page-table width past every context
        self.n_pages = len(lens) * per + 2
        self.table = torch.randperm(self.n_pages, generator=gen)[:len(lens) * per].view(len(lens), per)
        self.ctx = SimpleNamespace(cache=SimpleNamespace(page_size=ps), page_table=self.table)

    def rows(self, seq, tokens):
        return cache_rows(self.ctx, seq, tokens)


def latent_cache(paged, r, kind, gen):
    """The flat latent storage (float32 NaN, or 0xFF bytes: NaN scales) with every sequence's rows written."""
    R = paged.n_pages * paged.ps
    store = torch.full((R, r), float("nan")) if kind == "" else torch.full((R, row_bytes(r)), 255, dtype=torch.uint8)
    view = store if kind == "" else QuantisedRows(store, kind, r)
    for b, L in enumerate(paged.lens):
        rows = paged.rows(torch.full((1,), b), torch.arange(L)[None])[0]
        view[rows] = torch.randn(L, r, generator=gen) * 2
    if view[torch.tensor([0])].isnan().any():    # the eager gather reads row 0 for -1 (then weighs it 0)
        view[torch.tensor([0])] = torch.randn(1, r, generator=gen)
    return store, view


def decode_case(n, H, r, W, kind, seed, ps=8):
    gen = torch.Generator().manual_seed(seed)
    B = max(1, n // 2)
    lens = [int(x) for x in torch.randint(1, 3 * W, (B,), generator=gen)]
    paged = Paged(lens, ps, gen)
    store, view = latent_cache(paged, r, kind, gen)
    seq = torch.arange(n) % B
    tokens = torch.full((n, W), -1, dtype=torch.long)
    for i in range(n):
        L = lens[int(seq[i])]
        pick = torch.randperm(L, generator=gen)[:W]
        cols = torch.randperm(W, generator=gen)[:len(pick)]          # -1 padding anywhere in the row
        tokens[i, cols] = pick
    qk, v = 12, 10
    q = torch.randn(n, H, qk, generator=gen)
    kv_b = torch.randn(H * (qk + v), r, generator=gen) * 0.3
    return paged, store, view, seq, tokens, q, kv_b, qk, v


def pool_cache(paged, kpool, d, gen, dup=False):
    """The cache's pool keys [pages * ps / kpool, d] (NaN where no complete pool was written)."""
    store = torch.full((paged.n_pages * paged.ps // kpool, d), float("nan"))
    for b, L in enumerate(paged.lens):
        P = L // kpool
        keys = torch.randn(P, d, generator=gen)
        if dup and P > 2:       # exact ties: pools sharing one key score the same, bit for bit
            keys[1::3] = keys[0]
        first = torch.arange(P)[None] * kpool
        store[torch.div(paged.rows(torch.tensor([b]), first)[0], kpool, rounding_mode="floor")] = keys
    return store


def select_case(n, Hi, d, kpool, topk, seed, dup=False, zero_q=False, pools_a_page=4):
    gen = torch.Generator().manual_seed(seed)
    B = max(1, n // 2)
    lens = [int(x) for x in torch.randint(1, 3 * topk + 2 * kpool, (B,), generator=gen)]
    lens[0] = 3 * topk + 2 * kpool          # one context surely longer than the selection keeps
    paged = Paged(lens, pools_a_page * kpool, gen)
    pooled = pool_cache(paged, kpool, d, gen, dup)
    seq = torch.arange(n) % B
    # the last token of each context, or an earlier one (a speculative verification row)
    positions = torch.tensor([lens[int(s)] - 1 - (i // B) % 3 for i, s in enumerate(seq)]).clamp(min=0)
    q = torch.randn(n, Hi, d, generator=gen)
    if zero_q:
        q[::2] = 0.0          # every score 0: all tied
    w = torch.randn(n, Hi, generator=gen) * Hi ** -0.5
    return paged, pooled, seq, positions, q, w
