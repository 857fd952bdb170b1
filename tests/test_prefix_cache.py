import random

import pytest

from ouro.engine.page_pool import OutOfPages, PagePool
from ouro.engine.prefix_cache import PrefixCache

PS = 4


def make(n_pages=64, max_ckpt=100, interval=1):
    pool = PagePool(n_pages)
    evicted = []
    cache = PrefixCache(PS, pool, max_ckpt, on_evict_checkpoint=evicted.append, checkpoint_interval=interval)
    return pool, cache, evicted


def put(pool, cache, tokens, ckpts):
    """Simulate a finished prompt: allocate its pages, insert, drop the request's own refs."""
    pages = pool.alloc(-(-len(tokens) // PS))
    rejected = cache.insert(tokens, pages, ckpts)
    pool.decref(pages)
    return pages, rejected


def test_match_on_empty_tree():
    pool, cache, _ = make()
    for toks in ([], [1], list(range(12))):
        m = cache.match(toks)
        assert (m.pages, m.num_tokens, m.checkpoint, m.usable_tokens, m.usable_pages) == ([], 0, None, 0, [])
    assert cache.stats()["misses"] == 3 and cache.stats()["hits"] == 0 and cache.stats()["nodes"] == 0


def test_insert_then_match_full_partial_diverging():
    pool, cache, _ = make()
    toks = list(range(12)) + [99, 100]               # 3 full pages + a partial one
    pages = pool.alloc(4)
    assert cache.insert(toks, pages, {4: 10, 8: 11, 12: 12}) == []
    assert [pool.refcount(p) for p in pages] == [2, 2, 2, 1]   # partial page is not stored
    assert sorted(cache.held_pages()) == sorted(pages[:3])
    pool.decref(pages)

    m = cache.match(toks + [5])
    assert m.pages == pages[:3] and m.num_tokens == 12
    assert m.checkpoint == (12, 12) and m.usable_tokens == 12 and m.usable_pages == pages[:3]
    m = cache.match(toks[:9])                         # partial: only two full pages fit
    assert m.pages == pages[:2] and m.checkpoint == (8, 11) and m.usable_pages == pages[:2]
    m = cache.match(toks[:4] + [7, 7, 7, 7] + toks[8:])   # diverges inside page 2
    assert m.pages == pages[:1] and m.checkpoint == (4, 10) and m.usable_tokens == 4
    m = cache.match([42] + toks[1:])                  # diverges at the first token
    assert m.pages == [] and m.usable_tokens == 0
    s = cache.stats()
    assert (s["hits"], s["misses"], s["cached_tokens_served"]) == (3, 1, 12 + 8 + 4)


def test_existing_key_keeps_existing_page_and_rejects_bad_checkpoints():
    pool, cache, evicted = make()
    toks = list(range(8))
    old, _ = put(pool, cache, toks, {4: 1})
    new = pool.alloc(3)
    # 4: duplicate at a boundary that already has one; 6: not a boundary; 0 and 12: no stored page.
    rejected = cache.insert(toks + [8, 9, 10, 11], new, {0: 2, 4: 3, 6: 4, 8: 5, 12: 6, 16: 7})
    assert sorted(rejected) == [2, 3, 4, 7]
    assert cache.match(toks + [8, 9, 10, 11, 0]).pages == old + [new[2]]
    assert pool.refcount(new[0]) == 1 and pool.refcount(new[1]) == 1   # caller's copies untouched
    assert pool.refcount(new[2]) == 2
    assert sorted(cache.held_checkpoints()) == [1, 5, 6] and evicted == []


def test_clamp_to_deepest_checkpoint():
    pool, cache, _ = make()
    toks = list(range(20))                            # 5 full pages
    pages, _ = put(pool, cache, toks, {8: 77})        # checkpoint only after page 2
    m = cache.match(toks + [1, 2])
    assert m.pages == pages and m.num_tokens == 20    # the KV hit is reported in full...
    assert m.checkpoint == (8, 77) and m.usable_tokens == 8 and m.usable_pages == pages[:2]  # ...but clamped


def test_leave_one_token_clamp_on_page_aligned_fully_cached_prompt():
    pool, cache, _ = make()
    toks = list(range(12))
    pages, _ = put(pool, cache, toks, {4: 1, 8: 2, 12: 3})
    m = cache.match(toks)
    assert m.num_tokens == 12 and m.usable_tokens == 8 and m.checkpoint == (8, 2)
    assert m.usable_pages == pages[:2] and m.usable_tokens <= len(toks) - 1
    # One more token: now the checkpoint at 12 is usable.
    assert cache.match(toks + [0]).usable_tokens == 12
    # Only a checkpoint at the very end: nothing usable for the aligned prompt.
    pool2, cache2, _ = make()
    put(pool2, cache2, toks, {12: 9})
    m = cache2.match(toks)
    assert m.usable_tokens == 0 and m.checkpoint is None and m.usable_pages == [] and len(m.pages) == 3


def test_lock_prevents_eviction_and_holds_page_refs():
    pool, cache, evicted = make(n_pages=8)
    a, _ = put(pool, cache, [1] * 8, {8: 100})
    b, _ = put(pool, cache, [2] * 8, {8: 200})
    m = cache.match([1] * 9)
    assert pool.refcount(a[0]) == 1
    cache.lock(m)
    assert [pool.refcount(p) for p in a] == [2, 2]
    with pytest.raises(ValueError):
        cache.lock(m)
    assert cache.evict_pages(100) == 2                # only b's two pages can go
    assert evicted == [200] and sorted(cache.held_pages()) == sorted(a)
    assert cache.match([1] * 9).usable_tokens == 8
    cache.unlock(m)
    assert [pool.refcount(p) for p in a] == [1, 1]
    assert cache.evict_pages(100) == 2 and evicted == [200, 100]
    assert pool.num_free == pool.num_total


def test_lock_of_stale_match_raises():
    pool, cache, _ = make()
    put(pool, cache, [3] * 4, {4: 1})
    m = cache.match([3] * 5)
    cache.evict_pages(1)
    with pytest.raises(ValueError):
        cache.lock(m)
    with pytest.raises(ValueError):
        cache.unlock(m)


def test_lru_eviction_order_of_leaves():
    pool, cache, _ = make()
    a, _ = put(pool, cache, [1] * 4, {})
    b, _ = put(pool, cache, [2] * 4, {})
    c, _ = put(pool, cache, [3] * 8, {})              # two pages: the leaf must go before its parent
    cache.match([1] * 4)                              # touch a: it is now the most recent
    order = []
    while cache.stats()["nodes"]:
        before = set(cache.held_pages())
        assert cache.evict_pages(1) == 1
        order += list(before - set(cache.held_pages()))
    assert order == [b[0], c[1], c[0], a[0]]
    assert pool.num_free == pool.num_total


def test_evict_counts_only_pages_actually_freed():
    pool, cache, _ = make()
    pages = pool.alloc(2)
    cache.insert([5] * 8, pages, {})                  # the request still holds its refs
    assert cache.evict_pages(2) == 0 and cache.stats()["nodes"] == 0
    assert [pool.refcount(p) for p in pages] == [1, 1]
    pool.decref(pages)
    assert pool.num_free == pool.num_total


def test_checkpoint_lru_bound_with_callback():
    pool, cache, evicted = make(max_ckpt=2)
    put(pool, cache, [1] * 4, {4: 10})
    put(pool, cache, [2] * 4, {4: 20})
    cache.match([1] * 5)                              # 10 used: 20 is now least recent
    put(pool, cache, [3] * 4, {4: 30})
    assert evicted == [20] and sorted(cache.held_checkpoints()) == [10, 30]
    assert cache.stats()["checkpoints_held"] == 2
    assert cache.match([2] * 5).usable_tokens == 0 and cache.match([2] * 5).num_tokens == 4
    # With every held checkpoint locked, a new one is refused rather than exceeding the bound.
    m1, m3 = cache.match([1] * 5), cache.match([3] * 5)
    cache.lock(m1)
    cache.lock(m3)
    _, rejected = put(pool, cache, [4] * 4, {4: 40})
    assert rejected == [40] and evicted == [20] and cache.stats()["checkpoints_held"] == 2
    cache.unlock(m1)
    _, rejected = put(pool, cache, [4] * 4, {4: 41})
    assert rejected == [] and evicted == [20, 10] and sorted(cache.held_checkpoints()) == [30, 41]
    cache.unlock(m3)


def test_tight_bound_keeps_deepest_checkpoints_of_one_insert():
    pool, cache, evicted = make(max_ckpt=1)
    put(pool, cache, list(range(12)), {4: 1, 8: 2, 12: 3})
    assert cache.held_checkpoints() == [3] and evicted == [1, 2]


def test_should_checkpoint_interval():
    _, cache, _ = make(interval=2)
    assert [n for n in range(0, 33) if cache.should_checkpoint(n)] == [8, 16, 24, 32]
    _, cache1, _ = make()
    assert [n for n in range(0, 13) if cache1.should_checkpoint(n)] == [4, 8, 12]


def test_no_leaks_after_full_lifecycle():
    pool, cache, evicted = make(n_pages=32, max_ckpt=3)
    live = set()
    for i, toks in enumerate([[1] * 12, [1] * 8 + [2] * 4, [3] * 10, [1] * 4 + [4] * 9]):
        ck = {n: 10 * i + n for n in range(PS, len(toks) + 1, PS)}
        live |= set(ck.values())
        _, rejected = put(pool, cache, toks, ck)
        live -= set(rejected)
    live -= set(evicted)
    assert set(cache.held_checkpoints()) == live and len(live) <= 3
    matches = [cache.match(t) for t in ([1] * 13, [1] * 8 + [2] * 5, [3] * 11)]
    for m in matches:
        cache.lock(m)
    assert pool.num_free < pool.num_total
    for m in matches:
        cache.unlock(m)
    cache.evict_pages(10 ** 6)
    assert pool.num_free == pool.num_total
    assert set(evicted) >= live and cache.held_checkpoints() == []
    s = cache.stats()
    assert (s["nodes"], s["pages_held"], s["checkpoints_held"]) == (0, 0, 0)


def test_randomized_invariants():
    rng = random.Random(1234)
    ps, max_ckpt = 2, 5
    pool = PagePool(24)
    live = set()
    cache = PrefixCache(ps, pool, max_ckpt, on_evict_checkpoint=lambda c: live.remove(c))
    page_prefix, ckpt_prefix = {}, {}   # what each page / checkpoint was computed from
    active = []                         # (match, own pages) of running requests
    next_id = iter(range(10 ** 9))

    def rand_prompt():
        return [rng.randrange(3) for _ in range(rng.randint(1, 11))]

    def check_match(toks, m):
        assert m.num_tokens == len(m.pages) * ps and m.usable_tokens % ps == 0
        assert m.usable_tokens <= max(len(toks) - 1, 0) and m.usable_tokens <= m.num_tokens
        assert m.usable_pages == m.pages[:m.usable_tokens // ps]
        for i, p in enumerate(m.pages):             # never serve KV computed from other tokens
            assert page_prefix[p] == tuple(toks[:(i + 1) * ps])
        if m.checkpoint is None:
            assert m.usable_tokens == 0
        else:
            assert m.checkpoint[0] == m.usable_tokens > 0 and m.checkpoint[1] in live
            assert ckpt_prefix[m.checkpoint[1]] == tuple(toks[:m.usable_tokens])

    def invariants():
        held = cache.held_pages()
        assert len(held) == len(set(held)) == cache.stats()["nodes"]
        expected = [0] * pool.num_total
        for p in held:
            expected[p] += 1
        for m, own in active:
            for p in m.usable_pages + own:
                expected[p] += 1
        assert [pool.refcount(p) for p in range(pool.num_total)] == expected
        assert pool.num_free == expected.count(0) and pool.num_free + pool.num_used == pool.num_total
        assert all(pool.refcount(p) >= 1 for p in held)
        assert set(cache.held_checkpoints()) == live and len(live) <= max_ckpt

    for _ in range(300):
        op = rng.random()
        if op < 0.4:                                # admit and run a request's prompt
            toks = rand_prompt()
            m = cache.match(toks)
            check_match(toks, m)
            cache.lock(m)
            need = -(-len(toks) // ps) - len(m.usable_pages)
            try:
                own = pool.alloc(need)
            except OutOfPages:
                cache.evict_pages(need - pool.num_free)
                try:
                    own = pool.alloc(need)
                except OutOfPages:
                    cache.unlock(m)
                    invariants()
                    continue
            pages = m.usable_pages + own
            for i, p in enumerate(own, start=len(m.usable_pages)):
                page_prefix[p] = tuple(toks[:(i + 1) * ps])
            ck = {}
            for n in range(m.usable_tokens + ps, len(toks) + 1, ps):
                if rng.random() < 0.6:
                    ck[n] = next(next_id)
            if rng.random() < 0.2:
                ck[m.usable_tokens + 1] = next(next_id)   # off-boundary: must be rejected
            for n, c in ck.items():
                ckpt_prefix[c] = tuple(toks[:n])
            live.update(ck.values())
            active.append((m, own))
            rejected = cache.insert(toks, pages, ck)
            assert all(c in ck.values() for c in rejected)
            live.difference_update(rejected)
        elif op < 0.65 and active:                  # a request finishes
            m, own = active.pop(rng.randrange(len(active)))
            pool.decref(own)
            cache.unlock(m)
        elif op < 0.85:
            toks = rand_prompt()
            check_match(toks, cache.match(toks))
        else:
            before = pool.num_free
            freed = cache.evict_pages(rng.randint(1, 5))
            assert pool.num_free - before == freed
        invariants()

    while active:
        m, own = active.pop()
        pool.decref(own)
        cache.unlock(m)
    cache.evict_pages(10 ** 6)
    assert pool.num_free == pool.num_total and live == set() and cache.stats()["nodes"] == 0
    s = cache.stats()
    assert s["hits"] > 0 and s["misses"] > 0
