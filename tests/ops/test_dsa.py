"""DSA kernels: lightning-indexer pool compression / top-k selection and sparse latent MLA, each
against its naive reference."""

import pytest
import torch

from ouro.ops.dsa import (absorb_weights, index_select, index_select_naive, pool_keys, sparse_mla,
                          sparse_mla_chunk, sparse_mla_naive, stable_topk_mask)


from tests.helpers.numerics import assert_close, rel_rms  # noqa: F401


# ---------------------------------------------------------------------------------------------
# pool_keys


@pytest.mark.parametrize("kpool,P", [(4, 5), (16, 3), (4, 1)])
def test_pool_keys_matches_hand_loop(kpool, P):
    gen = torch.Generator().manual_seed(kpool * 10 + P)
    d = 8
    keys = torch.randn(P * kpool, d, generator=gen)
    gates = torch.randn(P * kpool, d, generator=gen) * 2
    ape = torch.randn(kpool, d, generator=gen)
    got = pool_keys(keys, gates, ape)
    assert got.shape == (P, d)
    ref = torch.empty(P, d)
    for p in range(P):
        for c in range(d):
            logits = [float(gates[p * kpool + j, c] + ape[j, c]) for j in range(kpool)]
            m = max(logits)
            ex = [torch.tensor(lg - m, dtype=torch.float64).exp().item() for lg in logits]
            z = sum(ex)
            ref[p, c] = sum(ex[j] / z * float(keys[p * kpool + j, c]) for j in range(kpool))
    assert_close(got, ref)


def test_pool_keys_uniform_gate_is_mean():
    """Zero gates and zero position embedding: every token weighs 1/kpool, the pool key is the mean."""
    keys = torch.randn(3 * 4, 5)
    got = pool_keys(keys, torch.zeros_like(keys), torch.zeros(4, 5))
    assert_close(got, keys.view(3, 4, 5).mean(1))


# ---------------------------------------------------------------------------------------------
# stable_topk_mask


def brute_topk_mask(scores, k):
    mask = torch.zeros_like(scores, dtype=torch.bool)
    for i, row in enumerate(scores.tolist()):
        for j in sorted(range(len(row)), key=lambda j: (-row[j], j))[:k]:
            mask[i, j] = True
    return mask


@pytest.mark.parametrize("k", [1, 3, 5, 8])
def test_stable_topk_mask(k):
    gen = torch.Generator().manual_seed(k)
    rows = [
        torch.zeros(8),                                        # all tied
        torch.tensor([1., 2., 2., 2., 0., 2., 1., 3.]),         # ties straddle the boundary
        torch.tensor([5., 5., 5., 5., 5., 5., 5., 9.]),
        torch.tensor([float("-inf")] * 5 + [1., 1., 1.]),      # masked entries fill the tail
        torch.randn(8, generator=gen),                          # no ties
        torch.randint(0, 3, (8,), generator=gen).float(),       # many ties
    ]
    scores = torch.stack(rows)
    mask = stable_topk_mask(scores, k)
    assert mask.dtype == torch.bool and mask.shape == scores.shape
    assert (mask.sum(-1) == k).all(), f"row counts {mask.sum(-1).tolist()} != {k}"
    assert torch.equal(mask, brute_topk_mask(scores, k))


def test_stable_topk_mask_batched_rows():
    """3-D input, many random tie patterns."""
    gen = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 4, (3, 20, 12), generator=gen).float()
    mask = stable_topk_mask(scores, 5)
    assert (mask.sum(-1) == 5).all()
    assert torch.equal(mask, brute_topk_mask(scores.view(-1, 12), 5).view_as(mask))


# ---------------------------------------------------------------------------------------------
# index_select


def make_context(L, kpool, d, Hi, gen):
    keys = torch.randn(L, d, generator=gen)
    gates = torch.randn(L, d, generator=gen)
    ape = torch.randn(kpool, d, generator=gen) * 0.5
    return keys, gates, ape


def run_index(q, w, keys, gates, ape, positions, select_k, kpool, scale):
    L = keys.shape[0]
    n_tok = L // kpool * kpool
    pooled = pool_keys(keys[:n_tok], gates[:n_tok], ape)
    width = select_k * kpool + kpool - 1
    out = index_select(q, w, pooled, positions, select_k, kpool, scale, width)
    ref = index_select_naive(q, w, keys, gates, ape, positions, select_k, kpool, scale)
    return out, ref, width


def check_selection(out, ref, positions, width):
    assert out.dtype == torch.long and out.shape == (len(ref), width)
    for i, expected in enumerate(ref):
        row = out[i]
        assert ((row >= 0) | (row == -1)).all(), "indices must be >= 0 or the -1 filler"
        got = sorted(row[row >= 0].tolist())
        assert len(set(got)) == len(got), f"query {i}: duplicate tokens {got}"
        assert all(t <= int(positions[i]) for t in got), f"query {i} at {int(positions[i])} sees the future"
        assert got == expected, f"query {i} (pos {int(positions[i])}): {got} != {expected}"


INDEX_CASES = [  # (kpool, select_k, L)
    (16, 2, 9),    # no complete pool yet (P = 0): only the tail
    (4, 3, 10),    # context shorter than topk (P = 2 <= select_k)
    (4, 3, 12),    # P == select_k
    (4, 3, 41),    # longer (P = 10)
    (16, 2, 20),   # shorter
    (16, 2, 100),  # longer (P = 6)
    (4, 1, 30),    # keep a single pool
]


@pytest.mark.parametrize("kpool,select_k,L", INDEX_CASES, ids=[f"kp{a}-sk{b}-L{c}" for a, b, c in INDEX_CASES])
def test_index_select_matches_naive(kpool, select_k, L):
    gen = torch.Generator().manual_seed(kpool * 1000 + select_k * 100 + L)
    d, Hi = 16, 4
    keys, gates, ape = make_context(L, kpool, d, Hi, gen)
    positions = torch.arange(L)  # every position: the first tokens, pool boundaries and in between
    assert L < kpool or any((p + 1) % kpool == 0 for p in positions.tolist())
    assert any((p + 1) % kpool != 0 for p in positions.tolist())
    q = torch.randn(L, Hi, d, generator=gen)
    w = torch.randn(L, Hi, generator=gen)  # signed head weights, as weights_proj produces
    out, ref, width = run_index(q, w, keys, gates, ape, positions, select_k, kpool, d ** -0.5)
    check_selection(out, ref, positions, width)
    # sanity on the reference itself: a query sees min(visible pools, select_k) pools plus its tail
    for i, pos in enumerate(positions.tolist()):
        n_vis = (pos + 1) // kpool
        assert len(ref[i]) == min(n_vis, select_k) * kpool + (pos + 1 - n_vis * kpool)


@pytest.mark.parametrize("kpool,select_k,L", [(4, 3, 41), (16, 2, 100)])
def test_index_select_subset_of_queries(kpool, select_k, L):
    """Decode-like: a few queries at arbitrary positions of a long context (not a full prefill)."""
    gen = torch.Generator().manual_seed(L)
    d, Hi = 16, 4
    keys, gates, ape = make_context(L, kpool, d, Hi, gen)
    positions = torch.tensor([L - 1, 0, kpool - 1, kpool, 2 * kpool - 2, L - 2])
    q = torch.randn(len(positions), Hi, d, generator=gen)
    w = torch.rand(len(positions), Hi, generator=gen)
    out, ref, width = run_index(q, w, keys, gates, ape, positions, select_k, kpool, d ** -0.5)
    check_selection(out, ref, positions, width)


def tie_context(kpool, d, gen, P=8, best=6, dups=(1, 3, 4)):
    """Positive keys so every score is positive; pool `best` scores highest, pools `dups` are exact
    duplicates of one another (same keys and gates) and score second, the rest score lower."""
    L = P * kpool + kpool // 2  # plus an incomplete tail pool
    keys = torch.rand(L, d, generator=gen) * 0.9           # entries < 0.9
    gates = torch.randn(L, d, generator=gen)
    base_k = 1 + torch.rand(kpool, d, generator=gen)       # entries in [1, 2)
    base_g = torch.randn(kpool, d, generator=gen)
    for p in dups:
        keys[p * kpool:(p + 1) * kpool] = 2 * base_k
        gates[p * kpool:(p + 1) * kpool] = base_g
    keys[best * kpool:(best + 1) * kpool] = 3 * base_k
    gates[best * kpool:(best + 1) * kpool] = base_g
    ape = torch.randn(kpool, d, generator=gen) * 0.5
    return keys, gates, ape


@pytest.mark.parametrize("kpool", [4, 16])
def test_index_select_exact_ties(kpool):
    """Exact ties must go to the lower pool, in both implementations, and a query's selection must
    not depend on which other queries share its batch."""
    gen = torch.Generator().manual_seed(kpool)
    d, Hi, select_k = 16, 4, 3
    keys, gates, ape = tie_context(kpool, d, gen)
    L = keys.shape[0]
    pooled = pool_keys(keys[:8 * kpool], gates[:8 * kpool], ape)
    assert torch.equal(pooled[1], pooled[3]) and torch.equal(pooled[1], pooled[4])
    positions = torch.tensor([L - 1, L - 1, L - 1, L - 3, 5 * kpool - 1, 5 * kpool, 7 * kpool - 1, L - 2])
    n = len(positions)
    q = torch.rand(n, Hi, d, generator=gen) + 0.1   # positive: scores order like the pool keys' norms
    q[1] = 0.0                                      # all-zero query rows: every pool scores 0
    q[5] = 0.0
    w = torch.rand(n, Hi, generator=gen) + 0.1
    out, ref, width = run_index(q, w, keys, gates, ape, positions, select_k, kpool, d ** -0.5)
    check_selection(out, ref, positions, width)

    def pools_of(row):
        return sorted({t // kpool for t in row.tolist() if t >= 0 and t < (int(positions[0]) + 1) // kpool * kpool})

    # full context: best pool 6, then the lowest two of the tied duplicates 1, 3, 4
    assert pools_of(out[0]) == [1, 3, 6]
    # zero query: all 8 pools tie at 0, the lowest three win
    assert pools_of(out[1]) == [0, 1, 2]
    # query at pos 5*kpool-1 sees pools 0..4: best is invisible, ties among 1, 3, 4 -> all three kept
    assert sorted({t // kpool for t in out[4].tolist() if t >= 0}) == [1, 3, 4]

    # scored alone, in reversed order, or in a batch: the same selection
    for i in range(n):
        alone, _, _ = run_index(q[i:i + 1], w[i:i + 1], keys, gates, ape, positions[i:i + 1],
                                select_k, kpool, d ** -0.5)
        assert torch.equal(alone[0], out[i]), f"query {i}: alone {alone[0].tolist()} != batched {out[i].tolist()}"
    rev = torch.arange(n - 1, -1, -1)
    out_rev, _, _ = run_index(q[rev], w[rev], keys, gates, ape, positions[rev], select_k, kpool, d ** -0.5)
    assert torch.equal(out_rev, out[rev])


def test_index_select_batch_invariance_random():
    """Random (tie-free) data: a query's selection is the same alone and within a prefill batch."""
    gen = torch.Generator().manual_seed(99)
    kpool, select_k, L, d, Hi = 4, 3, 48, 16, 4
    keys, gates, ape = make_context(L, kpool, d, Hi, gen)
    positions = torch.arange(L)
    q = torch.randn(L, Hi, d, generator=gen)
    w = torch.randn(L, Hi, generator=gen)
    out, _, _ = run_index(q, w, keys, gates, ape, positions, select_k, kpool, d ** -0.5)
    for i in range(0, L, 5):
        alone, _, _ = run_index(q[i:i + 1], w[i:i + 1], keys, gates, ape, positions[i:i + 1], select_k, kpool,
                                d ** -0.5)
        assert torch.equal(alone[0], out[i])


# ---------------------------------------------------------------------------------------------
# sparse MLA


def mla_setup(n, L, gen, H=4, qk=8, v=6, r=16):
    q = torch.randn(n, H, qk, generator=gen)
    latents = torch.randn(L, r, generator=gen)
    kv_b = torch.randn(H * (qk + v), r, generator=gen) * r ** -0.5
    w_uk, w_uv = absorb_weights(kv_b, H, qk, v)
    assert w_uk.shape == (H, qk, r) and w_uv.shape == (H, v, r)
    return q, latents, kv_b, w_uk, w_uv, qk ** -0.5


def random_selection(n, L, W, gen):
    """Each query (at position L-n+i) gets a random set of distinct causal tokens (always itself)
    scattered over W slots, the rest -1."""
    sel = torch.full((n, W), -1, dtype=torch.long)
    for i in range(n):
        pos = L - n + i
        m = int(torch.randint(1, min(W, pos + 1) + 1, (1,), generator=gen))
        toks = torch.randperm(pos + 1, generator=gen)[:m]
        if pos not in toks.tolist():
            toks[0] = pos
        slots = torch.randperm(W, generator=gen)[:m]
        sel[i, slots] = toks
    return sel


@pytest.mark.parametrize("block", [3, 4, 256])
@pytest.mark.parametrize("n,L,W", [(10, 30, 12), (1, 40, 7), (7, 7, 5)])
def test_sparse_mla_matches_naive(n, L, W, block):
    gen = torch.Generator().manual_seed(n * 100 + L + W)
    q, latents, kv_b, w_uk, w_uv, scale = mla_setup(n, L, gen)
    sel = random_selection(n, L, W, gen)
    assert (sel == -1).any()
    got = sparse_mla(q, latents, sel, w_uk, w_uv, scale, block=block)
    ref = sparse_mla_naive(q, latents, sel, kv_b, scale)
    assert got.shape == (n, 4, 6)
    assert_close(got, ref)


@pytest.mark.parametrize("block", [3, 4, 256])
@pytest.mark.parametrize("n,L", [(10, 10), (6, 25), (1, 9)])
def test_sparse_mla_causal_dense(n, L, block):
    """selected=None (causal-dense) equals an explicit full causal selection."""
    gen = torch.Generator().manual_seed(n * 7 + L)
    q, latents, kv_b, w_uk, w_uv, scale = mla_setup(n, L, gen)
    full = torch.full((n, L), -1, dtype=torch.long)
    for i in range(n):
        pos = L - n + i
        full[i, :pos + 1] = torch.arange(pos + 1)
    dense = sparse_mla(q, latents, None, w_uk, w_uv, scale, block=block)
    assert_close(dense, sparse_mla_naive(q, latents, full, kv_b, scale))
    assert_close(dense, sparse_mla(q, latents, full, w_uk, w_uv, scale, block=block))


@pytest.mark.parametrize("widths", [0, 4, 1000])      # gathered rows only, the default, masked only
@pytest.mark.parametrize("block", [3, 256])
@pytest.mark.parametrize("n,L,W", [(10, 30, 12), (1, 40, 7), (7, 7, 5), (20, 20, 3)])
def test_sparse_mla_chunk_matches_naive(n, L, W, block, widths, monkeypatch):
    """A prefill chunk against the sequence's latents: the masked dense product and the gathered
    rows both equal the naive expansion (a NaN-poisoned output row left unwritten fails)."""
    import sys
    monkeypatch.setattr(sys.modules["ouro.ops.dsa.sparse_mla"], "MASKED_WIDTHS", widths)
    gen = torch.Generator().manual_seed(n * 100 + L + W + 1)
    q, latents, kv_b, w_uk, w_uv, scale = mla_setup(n, L, gen)
    sel = random_selection(n, L, W, gen)
    got = sparse_mla_chunk(q, latents, sel, w_uk, w_uv, scale, block=block)
    assert got.shape == (n, 4, 6) and not got.isnan().any()
    assert_close(got, sparse_mla_naive(q, latents, sel, kv_b, scale))
    # the same rows through the cache-wide form (rows of `latents` as the cache)
    assert_close(got, sparse_mla(q, latents, sel, w_uk, w_uv, scale, block=block))


def test_sparse_mla_chunk_ignores_unused_slots_and_keeps_token_zero():
    """-1 slots go to a spare column: a row whose only token is 0 beside unused slots attends to it
    (a scatter of -1 onto column 0 would have masked token 0 out and made the row NaN)."""
    gen = torch.Generator().manual_seed(3)
    q, latents, kv_b, w_uk, w_uv, scale = mla_setup(3, 9, gen)
    sel = torch.tensor([[-1, 0, -1], [0, -1, 1], [-1, -1, 0]])
    got = sparse_mla_chunk(q, latents, sel, w_uk, w_uv, scale)
    assert_close(got, sparse_mla_naive(q, latents, sel, kv_b, scale))


def test_sparse_mla_selection_matters():
    """Guard against a vacuous comparison: a different selection changes the output."""
    gen = torch.Generator().manual_seed(1)
    n, L = 4, 20
    q, latents, kv_b, w_uk, w_uv, scale = mla_setup(n, L, gen)
    a = sparse_mla(q, latents, torch.arange(16, 20).view(n, 1).repeat(1, 2) - torch.tensor([0, 5]), w_uk, w_uv,
                   scale)
    b = sparse_mla(q, latents, None, w_uk, w_uv, scale)
    assert rel_rms(a, b) > 1e-2


def test_index_select_in_row_blocks_equals_one_pass(monkeypatch):
    """Long contexts score queries in row blocks; the selection must not change."""
    import ouro.ops.dsa.indexer as ix
    g = torch.Generator().manual_seed(11)
    n, Hi, d, P, kpool = 37, 2, 8, 30, 4
    q, w = torch.randn(n, Hi, d, generator=g), torch.randn(n, Hi, generator=g)
    pooled = torch.randn(P, d, generator=g)
    pos = torch.arange(P * kpool - n, P * kpool)
    whole = ix.index_select(q, w, pooled, pos, 5, kpool, 0.3, 5 * kpool + kpool - 1)
    monkeypatch.setattr(ix, "SCORE_BUDGET", Hi * P * 4)  # blocks of 4 rows
    assert torch.equal(ix.index_select(q, w, pooled, pos, 5, kpool, 0.3, 5 * kpool + kpool - 1), whole)


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "selected"])
def test_sparse_mla_widens_bfloat16_to_float32(dense):
    """bf16 inputs: scores, softmax and weighted sum run in fp32 (the result is the fp32 computation
    on the same bf16 values, rounded once), returned in bf16."""
    gen = torch.Generator().manual_seed(3)
    n, L = 6, 25
    q, latents, kv_b, w_uk, w_uv, scale = mla_setup(n, L, gen)
    q, latents, w_uk, w_uv = (t.bfloat16() for t in (q, latents, w_uk, w_uv))
    sel = None if dense else random_selection(n, L, 9, gen)
    got = sparse_mla(q, latents, sel, w_uk, w_uv, scale)
    ref = sparse_mla(q.float(), latents.float(), sel, w_uk.float(), w_uv.float(), scale)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, ref.bfloat16())
