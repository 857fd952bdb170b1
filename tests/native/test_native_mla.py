"""DSA decode as native ops (`ouro/native/mla.cpp`): the sparse absorbed MLA over the paged latent cache
(float32 and quantised rows) against `sparse_mla`, a float64 run of it and `sparse_mla_naive`; the
indexer's selection against `index_select` (equal, ties included) and `index_select_naive`; every path
this machine runs; a tiny model's decode fused against `kernels.eager_only()`. Caches are NaN-poisoned
where nothing was written, so a read of a wrong row shows."""

from __future__ import annotations

import random

import pytest
import torch

from tests.helpers.mla_cases import Paged, decode_case, latent_cache, select_case
from tests.helpers.numerics import rel_rms
from ouro.native import kernels, mla
from ouro.ops.dsa import absorb_weights, index_select, index_select_naive, pool_keys, sparse_mla, sparse_mla_naive
from ouro.ops.quant.kv_rows import GROUP, encode_rows

PATHS = ["native", "portable"]


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        assert mla.can(torch.ones(1)), kernels.why_not("mla")
        yield


def on_path(path):
    return kernels.portable("mla") if path == "portable" else kernels.eager_only(False)


def fused_attend(q, store, kind, tokens, paged, seq, w_uk, w_uv, scale):
    q_lat = torch.einsum("nhd,hdr->nhr", q, w_uk) * scale
    o = mla.sparse_mla_decode(q_lat, store, kind, GROUP, tokens, paged.table, seq, paged.ps)
    return torch.einsum("nhr,hvr->nhv", o, w_uv)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ["", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("n,H,r,W", [(1, 1, 16, 5), (3, 3, 40, 37), (16, 8, 64, 70), (64, 3, 16, 9), (7, 8, 40, 33),
                                     (4, 3, 40, 150)])
def test_sparse_mla_decode_equals_eager_and_float64(path, kind, n, H, r, W):
    # pages of 8 rows (a power of two: the kernel shifts) and of 6 (it divides)
    paged, store, view, seq, tokens, q, kv_b, qk, v = decode_case(n, H, r, W, kind, seed=n * 100 + H * 10 + r,
                                                                  ps=8 if (n + H) % 2 == 0 else 6)
    w_uk, w_uv = absorb_weights(kv_b, H, qk, v)
    scale = qk ** -0.5
    rows = paged.rows(seq, tokens)
    ref = sparse_mla(q, view, rows, w_uk, w_uv, scale)
    ref64 = sparse_mla(q.double(), view, rows, w_uk.double(), w_uv.double(), scale)
    with on_path(path):
        got = fused_attend(q, store, kind, tokens, paged, seq, w_uk, w_uv, scale)
    assert got.shape == ref.shape and not got.isnan().any()
    assert rel_rms(got, ref) <= 1e-6
    # no less accurate than the eager path, give or take a few float32 roundings (2^-24 each) of a
    # softmax summed over W rows: on the AVX2 Zen 3 the portable path's int8 case at W = 150 came to
    # 8.3e-7 against the eager path's 3.6e-7 (still tighter than the 1e-6 above allows through)
    assert rel_rms(got, ref64) <= 2 * rel_rms(ref, ref64) + 5e-7


@pytest.mark.parametrize("H", [1, 3])
def test_sparse_mla_decode_equals_naive(H):
    paged, store, view, seq, tokens, q, kv_b, qk, v = decode_case(4, H, 24, 19, "", seed=H)
    w_uk, w_uv = absorb_weights(kv_b, H, qk, v)
    got = fused_attend(q, store, "", tokens, paged, seq, w_uk, w_uv, qk ** -0.5)
    for i in range(4):      # one sequence's rows, contiguous, for the naive expansion
        b = int(seq[i])
        latents = view[paged.rows(torch.tensor([b]), torch.arange(paged.lens[b])[None])[0]]
        ref = sparse_mla_naive(q[i:i + 1], latents, tokens[i:i + 1], kv_b, qk ** -0.5)
        assert rel_rms(got[i:i + 1], ref) <= 1e-6


def test_sparse_mla_decode_row_alone_equals_it_in_a_batch_and_empty_rows_are_nan():
    paged, store, view, seq, tokens, q, kv_b, qk, v = decode_case(12, 8, 40, 50, "int8", seed=5)
    w_uk, _ = absorb_weights(kv_b, 8, qk, v)
    tokens[3] = -1
    q_lat = torch.einsum("nhd,hdr->nhr", q, w_uk)
    full = mla.sparse_mla_decode(q_lat, store, "int8", GROUP, tokens, paged.table, seq, paged.ps)
    for i in (0, 5, 11):    # one request alone: split over heads instead of requests, same bits
        one = mla.sparse_mla_decode(q_lat[i:i + 1], store, "int8", GROUP, tokens[i:i + 1], paged.table, seq[i:i + 1],
                                    paged.ps)
        assert torch.equal(one, full[i:i + 1])
    assert full[3].isnan().all() and not full[torch.arange(12) != 3].isnan().any()


# ---------------------------------------------------------------------------------------------
# the indexer's selection


def eager_select(paged, pooled, seq, positions, q, w, select_k, kpool, scale, width):
    """The Indexer's eager decode path: pool keys gathered for the longest context, then index_select."""
    n_pools = max(paged.lens) // kpool
    first = torch.arange(n_pools).expand(len(seq), -1) * kpool
    rows = torch.div(paged.rows(seq, first), kpool, rounding_mode="floor")
    return index_select(q, w, pooled[rows], positions, select_k, kpool, scale, width)


def rule_select(paged, pooled, seq, positions, q, w, select_k, kpool, scale, width):
    """The selection rule written out: float64 pool scores, the best select_k with ties to the earlier
    pool (identical pools score identically here, whatever their column), pool order, then the tail."""
    out = torch.full((len(seq), width), -1, dtype=torch.long)
    for i in range(len(seq)):
        pos = int(positions[i])
        n_vis = (pos + 1) // kpool
        first = torch.arange(n_vis)[None] * kpool
        keys = pooled[torch.div(paged.rows(seq[i:i + 1], first)[0], kpool, rounding_mode="floor")].double()
        s = [float((w[i].double() * torch.relu(keys[p] @ q[i].double().T * scale)).sum()) for p in range(n_vis)]
        kept = sorted(sorted(range(n_vis), key=lambda p: (-s[p], p))[:select_k])
        toks = [p * kpool + j for p in kept for j in range(kpool)]
        out[i, :len(toks)] = torch.tensor(toks, dtype=torch.long)
        for j in range(kpool - 1):
            t = n_vis * kpool + j
            out[i, width - (kpool - 1) + j] = t if t <= pos else -1
    return out


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n,Hi,d,kpool,topk", [(1, 1, 16, 4, 16), (5, 3, 40, 4, 8), (16, 8, 64, 4, 64),
                                               (64, 3, 16, 2, 6), (9, 2, 24, 1, 5), (6, 4, 32, 16, 32)])
@pytest.mark.parametrize("ties", ["none", "dup", "zero"])
def test_index_select_decode_equals_eager(path, n, Hi, d, kpool, topk, ties):
    """Bit-equal to the eager selection; with pools of identical keys, to the rule itself: the eager
    einsum rounds identical columns differently (its vector body and remainder), so it can rank a later
    copy of a pool above an earlier one by an ulp."""
    # pages of 4 pools (a power of two where kpool is one) and of 3
    paged, pooled, seq, positions, q, w = select_case(n, Hi, d, kpool, topk, seed=n + Hi + d, dup=ties == "dup",
                                                      zero_q=ties == "zero", pools_a_page=3 if Hi % 2 else 4)
    args = (topk // kpool, kpool, d ** -0.5, topk + kpool - 1)
    with on_path(path):
        got = mla.index_select_decode(q, w, pooled, paged.table, seq, positions, paged.ps, *args)
    assert torch.equal(got, rule_select(paged, pooled, seq, positions, q, w, *args))
    if ties != "dup":
        assert torch.equal(got, eager_select(paged, pooled, seq, positions, q, w, *args))
    assert (positions + 1 > topk + kpool).any()         # some rows do select among more pools than they keep


@pytest.mark.parametrize("select_k", [1, 3, 50])
def test_index_select_decode_equals_naive(select_k):
    gen = torch.Generator().manual_seed(select_k)
    kpool, d, Hi = 4, 16, 3
    paged = Paged([23, 41, 9], 8, gen)
    store = torch.full((paged.n_pages * 2, d), float("nan"))
    keys, gates = [], []
    ape = torch.randn(kpool, d, generator=gen)
    for b, L in enumerate(paged.lens):
        keys.append(torch.randn(L, d, generator=gen))
        gates.append(torch.randn(L, d, generator=gen))
        P = L // kpool
        rows = torch.div(paged.rows(torch.tensor([b]), torch.arange(P)[None] * kpool)[0], kpool, rounding_mode="floor")
        store[rows] = pool_keys(keys[b][:P * kpool], gates[b][:P * kpool], ape)
    seq = torch.tensor([0, 1, 2, 1])
    positions = torch.tensor([22, 40, 8, 37])
    q = torch.randn(4, Hi, d, generator=gen)
    w = torch.randn(4, Hi, generator=gen)
    width = select_k * kpool + kpool - 1
    got = mla.index_select_decode(q, w, store, paged.table, seq, positions, paged.ps, select_k, kpool, d ** -0.5, width)
    for i in range(4):
        b = int(seq[i])
        ref = index_select_naive(q[i:i + 1], w[i:i + 1], keys[b], gates[b], ape, positions[i:i + 1], select_k, kpool,
                                 d ** -0.5)[0]
        assert sorted(t for t in got[i].tolist() if t >= 0) == ref


@pytest.mark.parametrize("path", PATHS)
def test_sparse_mla_decode_reads_a_permuted_query_in_place(path):
    """q_lat as the absorbed product leaves it ([H, n, r] seen as [n, H, r]): the same bits as its
    contiguous copy, and no copy made."""
    paged, store, view, seq, tokens, q, kv_b, qk, v = decode_case(5, 3, 40, 37, "", seed=7, ps=8)
    q_lat = torch.randn(3, 5, 40).permute(1, 0, 2)
    assert not q_lat.is_contiguous()
    with on_path(path):
        got = mla.sparse_mla_decode(q_lat, store, "", GROUP, tokens, paged.table, seq, paged.ps)
        assert torch.equal(got, mla.sparse_mla_decode(q_lat.contiguous(), store, "", GROUP, tokens, paged.table, seq,
                                                      paged.ps))
        with torch.profiler.profile() as prof:
            mla.sparse_mla_decode(q_lat, store, "", GROUP, tokens, paged.table, seq, paged.ps)
    assert not got.isnan().any()
    assert not any(e.key in ("aten::clone", "aten::contiguous") and e.count for e in prof.key_averages())


def test_bad_inputs_are_refused():
    paged, store, view, seq, tokens, q, kv_b, qk, v = decode_case(2, 2, 16, 4, "", seed=0)
    q_lat = torch.randn(2, 2, 16)
    with pytest.raises(RuntimeError, match="beyond the page table"):
        mla.sparse_mla_decode(q_lat, store, "", GROUP, tokens.fill_(10 ** 6), paged.table, seq, paged.ps)
    with pytest.raises(RuntimeError, match="kind"):
        mla.sparse_mla_decode(q_lat, store, "int4", GROUP, tokens, paged.table, seq, paged.ps)


def test_a_compiled_graph_holds_both_ops():
    paged, pooled, seq, positions, q, w = select_case(4, 3, 16, 4, 8, seed=2)
    args = (paged.ps, 2, 4, 0.25, 11)
    store = torch.randn(paged.n_pages * paged.ps, 16)
    q_lat = torch.randn(4, 3, 16)

    def step(q, w, q_lat):
        sel = mla.index_select_decode(q, w, pooled, paged.table, seq, positions, *args)
        return sel, mla.sparse_mla_decode(q_lat, store, "", GROUP, sel, paged.table, seq, paged.ps)
    sel, o = torch.compile(step, fullgraph=True, backend="aot_eager")(q, w, q_lat)
    ref_sel, ref_o = step(q, w, q_lat)
    assert torch.equal(sel, ref_sel) and torch.equal(o, ref_o)


# ---------------------------------------------------------------------------------------------
# the model's decode, fused against eager

def run_engine(checkpoint, prompts, mode, tokens=8):
    from ouro.config import EngineConfig
    from ouro.engine.llm_engine import LLMEngine
    from ouro.engine.sampling import SamplingParams
    from ouro.models.loader import load_model
    cfg = EngineConfig(page_size=16, max_memory=6 << 20, max_num_seqs=8, max_num_batched_tokens=64,
                       dtype="float32", **mode)
    engine = LLMEngine(load_model(checkpoint), None, cfg, verbose=False, record_logits=True)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    ids = [engine.add_request({"prompt_token_ids": p}, params) for p in prompts]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    out = [(done[i].token_ids, torch.stack(engine.logits_history[i])) for i in ids]
    engine.close()
    return out


@pytest.mark.parametrize("kv", ["auto", "int8", "fp8_e4m3"])
def test_tiny_model_decode_fused_equals_eager(tiny_checkpoint, monkeypatch, kv):
    """Contexts past index_topk (16 for tiny): the indexer selects, the attention reads its picks."""
    rng = random.Random(7)
    prompts = [[rng.randrange(1, 500) for _ in range(L)] for L in (40, 77, 23, 61)]
    mode = {"kv_cache_dtype": kv}
    # only the MLA family's ops give way: the other families' rounding is the same on both sides
    # (test_fused_step holds all of them together against eager; here, on the Xeon class, their
    # sum alone came to 1.04e-6 while these kernels added nothing measurable)
    with kernels.eager_only(families=("mla",)):
        ref = run_engine(tiny_checkpoint, prompts, mode)
        exact = run_engine(tiny_checkpoint, prompts, {}) if kv != "auto" else None
    calls = {"mla": 0, "select": 0}
    for name, key in (("sparse_mla_decode", "mla"), ("index_select_decode", "select")):
        real = getattr(mla, name)
        monkeypatch.setattr(mla, name, lambda *a, _r=real, _k=key: calls.__setitem__(_k, calls[_k] + 1) or _r(*a))
    got = run_engine(tiny_checkpoint, prompts, mode)
    assert calls["mla"] > 0 and calls["select"] > 0
    for i, ((t_ref, l_ref), (t_got, l_got)) in enumerate(zip(ref, got)):
        assert t_got == t_ref
        # quantised rows: a 1e-7 change upstream moves values across an int8 / fp8 step of a new row
        bound = 1e-6 if exact is None else max(1e-6, 0.25 * rel_rms(l_ref, exact[i][1]))
        assert rel_rms(l_got, l_ref) <= bound


@pytest.mark.parametrize("n", [1, 7, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8, torch.int8])
@pytest.mark.parametrize("strided", [False, True])
def test_write_rows_stores_exactly_the_indexed_store(dtype, strided, n):
    """`write_rows` (the compiled graph's cache store): dst[rows] = src in place, any element type, a
    dst whose rows are strided (a cache layer's view); rows outside dst are refused, nothing written."""
    g = torch.Generator().manual_seed(0)
    full = (torch.randn(40, 24, generator=g) * 50).to(dtype)
    dst = full[:, :16] if strided else full[:, :16].contiguous()
    want = dst.clone()
    rows = torch.randperm(dst.shape[0], generator=g)[:n]
    src = (torch.randn(n, 16, generator=g) * 50).to(dtype)
    want[rows] = src
    before = full.clone()
    kernels.ops("mla").write_rows(dst, rows, src)
    assert torch.equal(dst, want)
    if strided:       # the columns beside the view are untouched
        assert torch.equal(full[:, 16:], before[:, 16:])
    with pytest.raises(RuntimeError, match="outside"):
        kernels.ops("mla").write_rows(dst, torch.tensor([0, dst.shape[0]]), src[:1].expand(2, -1))
    assert torch.equal(dst, want)


# ---------------------------------------------------------------------------------------------
# the indexer's pool keys


def pool_keys_case(kind, d, kpool, dtype, seed):
    """Keys and gates of three sequences on shuffled pages (NaN / 0xFF where nobody wrote), an ape, the
    pools the batch completes (every complete pool of each sequence) and a NaN pool store."""
    gen = torch.Generator().manual_seed(seed)
    paged = Paged([5 * kpool + 1, 3 * kpool, kpool - 1 if kpool > 1 else 2], 4 * kpool, gen)
    R = paged.n_pages * paged.ps
    keys, key_view = latent_cache(paged, d, kind, gen)
    gates = torch.full((R, d), float("nan"), dtype=dtype)
    for b, L in enumerate(paged.lens):
        gates[paged.rows(torch.tensor([b]), torch.arange(L)[None])[0]] = (torch.randn(L, d, generator=gen) * 3).to(dtype)
    ape = torch.randn(kpool, d, generator=gen)
    seq = torch.cat([torch.full((L // kpool,), b) for b, L in enumerate(paged.lens)])
    ends = torch.cat([torch.arange(L // kpool) * kpool + kpool - 1 for L in paged.lens])
    store = torch.full((R // kpool, d), float("nan"))
    return paged, keys, key_view, gates, ape, seq, ends, store


def eager_pools(paged, key_view, gates, ape, seq, ends, kpool):
    tok = (ends + 1 - kpool)[:, None] + torch.arange(kpool)
    rows = paged.rows(seq, tok)
    pooled = pool_keys(key_view[rows.flatten()], gates[rows.flatten()], ape)
    dest = torch.div(rows[:, 0], kpool, rounding_mode="floor")
    return dest, pooled


# (quantised rows need a width whose scales stay 4-byte aligned: an odd width in float rows only)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind,d,kpool", [(k, d, p) for k in ("", "int8", "fp8_e4m3")
                                          for d, p in ((64, 4), (40, 2), (16, 1), (24, 16))] + [("", 37, 2)])
def test_pool_keys_write_equals_eager(path, kind, d, kpool):
    """Each completed pool's key written to its row (float32 rounding of the eager softmax and sum),
    nothing else written (the store's other rows stay NaN); the graph's form with a `complete` mask
    writes the same rows, the same bits, and nothing for the incomplete rows."""
    paged, keys, key_view, gates, ape, seq, ends, store = pool_keys_case(kind, d, kpool, torch.float32, seed=d + kpool)
    dest, want = eager_pools(paged, key_view, gates, ape, seq, ends, kpool)
    assert len(dest) > 3 and not want.isnan().any()
    with on_path(path):
        mla.pool_keys_write(store, keys, kind, GROUP, gates, ape, paged.table, seq, ends, None, paged.ps)
    assert rel_rms(store[dest], want) <= 1e-6
    untouched = torch.ones(store.shape[0], dtype=torch.bool)
    untouched[dest] = False
    assert store[untouched].isnan().all()
    # a graph: every token of the batch names its pool, the incomplete ones are skipped
    store2 = torch.full_like(store, float("nan"))
    tokens = torch.cat([torch.arange(L) for L in paged.lens])
    seqs = torch.cat([torch.full((L,), b) for b, L in enumerate(paged.lens)])
    complete = (tokens + 1) % kpool == 0
    assert kpool == 1 or not complete.all()
    with on_path(path):
        mla.pool_keys_write(store2, keys, kind, GROUP, gates, ape, paged.table, seqs, tokens, complete, paged.ps)
    assert torch.equal(store2[dest], store[dest])
    assert store2[untouched].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_keys_write_reads_a_bfloat16_cache_and_propagates_nan(dtype):
    paged, keys, key_view, gates, ape, seq, ends, store = pool_keys_case("", 32, 4, dtype, seed=3)
    keys = keys.to(dtype)
    gates[paged.rows(seq[:1], (ends[:1] - 1)[None])[0]] = float("nan")       # one gate of the first pool
    dest, want = eager_pools(paged, keys, gates, ape, seq, ends, 4)
    mla.pool_keys_write(store, keys, "", GROUP, gates, ape, paged.table, seq, ends, None, paged.ps)
    assert store[dest[0]].isnan().all() and want[0].isnan().all()
    assert rel_rms(store[dest[1:]], want[1:]) <= 1e-6


def test_pool_keys_write_refuses_a_pool_that_does_not_end_a_pool():
    paged, keys, key_view, gates, ape, seq, ends, store = pool_keys_case("", 16, 4, torch.float32, seed=5)
    before = store.clone()
    for bad in (ends + 1, ends.clone().fill_(2), ends.clone().fill_(paged.table.shape[1] * paged.ps + 3)):
        with pytest.raises(RuntimeError, match="pool"):
            mla.pool_keys_write(store, keys, "", GROUP, gates, ape, paged.table, seq, bad, None, paged.ps)
    assert torch.equal(store.isnan(), before.isnan())
