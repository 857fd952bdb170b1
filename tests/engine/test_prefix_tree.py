import random
from collections import Counter

import pytest

from ouro.engine.page_pool import OutOfPages, PagePool
from ouro.engine.prefix_cache import PrefixCache

PS = 4


def make(n_pages=64, max_ckpt=100, interval=1):
    pool, evicted = PagePool(n_pages), []
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
    assert (m.pages, m.num_tokens, m.checkpoint) == (pages[:3], 12, (12, 12))
    assert m.usable_tokens == 12 and m.usable_pages == pages[:3]
    m = cache.match(toks[:9])                         # partial: only two full pages fit
    assert m.pages == pages[:2] and m.checkpoint == (8, 11) and m.usable_pages == pages[:2]
    m = cache.match(toks[:4] + [7, 7, 7, 7] + toks[8:])   # diverges inside page 2
    assert m.pages == pages[:1] and m.checkpoint == (4, 10) and m.usable_tokens == 4
    m = cache.match([42] + toks[1:])                  # diverges at the first token
    assert m.pages == [] and m.usable_tokens == 0
    assert [cache.stats()[k] for k in ("hits", "misses", "cached_tokens_served")] == [3, 1, 12 + 8 + 4]


def test_existing_key_keeps_existing_page_and_rejects_bad_checkpoints():
    pool, cache, evicted = make()
    old, _ = put(pool, cache, toks := list(range(8)), {4: 1})
    new = pool.alloc(3)
    # 4: duplicate at a boundary that already has one; 6: not a boundary; 0 and 16: no stored page.
    rejected = cache.insert(toks + [8, 9, 10, 11], new, {0: 2, 4: 3, 6: 4, 8: 5, 12: 6, 16: 7})
    assert sorted(rejected) == [2, 3, 4, 7]
    assert cache.match(toks + [8, 9, 10, 11, 0]).pages == old + [new[2]]
    assert [pool.refcount(p) for p in new] == [1, 1, 2]   # caller's copies of cached pages untouched
    assert sorted(cache.held_checkpoints()) == [1, 5, 6] and evicted == []


def test_usable_prefix_clamps_to_deepest_checkpoint_and_leaves_one_token():
    pool, cache, _ = make()
    pages, _ = put(pool, cache, toks := list(range(20)), {8: 77})  # 5 full pages, checkpoint after page 2
    m = cache.match(toks + [1, 2])
    assert m.pages == pages and m.num_tokens == 20    # the KV hit is reported in full...
    assert m.checkpoint == (8, 77) and m.usable_tokens == 8 and m.usable_pages == pages[:2]  # ...but clamped
    # Leave-one-token clamp: a page-aligned, fully cached prompt still needs its last token computed.
    pages, _ = put(pool, cache, toks := list(range(100, 112)), {4: 1, 8: 2, 12: 3})
    m = cache.match(toks)
    assert (m.num_tokens, m.usable_tokens, m.checkpoint, m.usable_pages) == (12, 8, (8, 2), pages[:2])
    assert cache.match(toks + [0]).usable_tokens == 12    # one more token: the end checkpoint works
    # Only a checkpoint at the very end: nothing usable for the aligned prompt.
    pool2, cache2, _ = make()
    put(pool2, cache2, toks, {12: 9})
    m = cache2.match(toks)
    assert (m.usable_tokens, m.checkpoint, m.usable_pages, len(m.pages)) == (0, None, [], 3)


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
    assert cache.evict_pages(100) == 2 and evicted == [200, 100] and pool.num_free == pool.num_total
    with pytest.raises(ValueError):                   # its nodes are gone: the match is stale
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
    assert order == [b[0], c[1], c[0], a[0]] and pool.num_free == pool.num_total
    # Only pages that really return to the pool count: here the request still holds its refs.
    pages = pool.alloc(2)
    cache.insert([5] * 8, pages, {})
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
    assert cache.stats()["checkpoints_held"] == 2 and cache.match([2] * 5).num_tokens == 4
    assert cache.match([2] * 5).usable_tokens == 0   # its pages stay: only the checkpoint went
    # With every held checkpoint locked, a new one is refused rather than exceeding the bound.
    m1, m3 = cache.match([1] * 5), cache.match([3] * 5)
    for m in (m1, m3):
        cache.lock(m)
    _, rejected = put(pool, cache, [4] * 4, {4: 40})
    assert rejected == [40] and evicted == [20] and cache.stats()["checkpoints_held"] == 2
    cache.unlock(m1)
    _, rejected = put(pool, cache, [4] * 4, {4: 41})
    assert rejected == [] and evicted == [20, 10] and sorted(cache.held_checkpoints()) == [30, 41]
    cache.unlock(m3)
    # A tight bound keeps the deepest (most useful) checkpoints of one insert.
    pool, cache, evicted = make(max_ckpt=1)
    put(pool, cache, list(range(12)), {4: 1, 8: 2, 12: 3})
    assert cache.held_checkpoints() == [3] and evicted == [1, 2]


def test_should_checkpoint_interval():
    assert [n for n in range(33) if make(interval=2)[1].should_checkpoint(n)] == [8, 16, 24, 32]
    assert [n for n in range(13) if make()[1].should_checkpoint(n)] == [4, 8, 12]


def test_no_leaks_after_full_lifecycle():
    pool, cache, evicted = make(n_pages=32, max_ckpt=3)
    given, rejected = [], []
    for i, toks in enumerate([[1] * 12, [1] * 8 + [2] * 4, [3] * 10, [1] * 4 + [4] * 9]):
        ck = {n: 10 * i + n for n in range(PS, len(toks) + 1, PS)}
        given += ck.values()
        rejected += put(pool, cache, toks, ck)[1]
    assert len(cache.held_checkpoints()) == 3 and rejected    # shared prefixes give duplicates
    matches = [cache.match(t) for t in ([1] * 13, [1] * 8 + [2] * 5, [3] * 11)]
    for m in matches:
        cache.lock(m)
    uses = Counter(p for m in matches for p in m.usable_pages)  # shared prefixes: one ref per lock
    assert max(uses.values()) == 2 and all(pool.refcount(p) == 1 + c for p, c in uses.items())
    for m in matches:
        cache.unlock(m)
    assert cache.evict_pages(10 ** 6) > 0 and pool.num_free == pool.num_total
    assert sorted(evicted + rejected) == sorted(given)        # every id handed back exactly once
    assert [cache.stats()[k] for k in ("nodes", "pages_held", "checkpoints_held")] == [0, 0, 0]


def test_randomized_invariants():
    rng, ps, max_ckpt, pool, live = random.Random(1234), 2, 5, PagePool(24), set()
    cache = PrefixCache(ps, pool, max_ckpt, on_evict_checkpoint=lambda c: live.remove(c))
    prefix_of = {}                      # page / checkpoint -> tokens it was computed from
    active = []                         # (match, own pages) of running requests
    next_id = iter(range(10 ** 9))

    def check_match(toks):              # small alphabet so prefixes collide
        m = cache.match(toks)
        assert m.num_tokens == len(m.pages) * ps and m.usable_tokens % ps == 0
        assert m.usable_tokens <= max(len(toks) - 1, 0) and m.usable_tokens <= m.num_tokens
        assert m.usable_pages == m.pages[:m.usable_tokens // ps]
        for i, p in enumerate(m.pages):             # never serve KV computed from other tokens
            assert prefix_of["p", p] == tuple(toks[:(i + 1) * ps])
        assert (m.checkpoint is None) == (m.usable_tokens == 0)
        if m.checkpoint is not None:
            assert m.checkpoint[0] == m.usable_tokens and m.checkpoint[1] in live
            assert prefix_of["c", m.checkpoint[1]] == tuple(toks[:m.usable_tokens])
        return m

    def admit():
        m = check_match(toks := [rng.randrange(3) for _ in range(rng.randint(1, 11))])
        cache.lock(m)
        need = -(-len(toks) // ps) - len(m.usable_pages)
        if need > pool.num_free:                    # what the engine does when alloc fails
            cache.evict_pages(need - pool.num_free)
        try:
            own = pool.alloc(need)
        except OutOfPages:
            return cache.unlock(m)
        pages = m.usable_pages + own
        prefix_of.update((("p", p), tuple(toks[:(i + 1) * ps])) for i, p in enumerate(pages))
        ck = {n: next(next_id) for n in range(m.usable_tokens + ps, len(toks) + 1, ps) if rng.random() < 0.6}
        if rng.random() < 0.2:
            ck[m.usable_tokens + 1] = next(next_id)   # off-boundary: must be rejected
        prefix_of.update((("c", c), tuple(toks[:n])) for n, c in ck.items())
        live.update(ck.values())
        active.append((m, own))
        rejected = cache.insert(toks, pages, ck)
        assert set(rejected) <= set(ck.values())
        assert m.usable_tokens + 1 not in ck or ck[m.usable_tokens + 1] in rejected
        live.difference_update(rejected)

    def invariants():
        held = cache.held_pages()
        assert len(held) == len(set(held)) == cache.stats()["nodes"]
        # Every reference is accounted for: tree nodes + locks + request-owned pages.
        expected = Counter(held) + Counter(p for m, own in active for p in m.usable_pages + own)
        assert all(pool.refcount(p) == expected[p] for p in range(pool.num_total))
        assert pool.num_free == pool.num_total - len(expected) and pool.num_free + pool.num_used == pool.num_total
        assert set(cache.held_checkpoints()) == live and len(live) <= max_ckpt

    for _ in range(300):
        op = rng.random()
        if op < 0.4:
            admit()
        elif op < 0.65 and active:                  # a request finishes
            m, own = active.pop(rng.randrange(len(active)))
            pool.decref(own)
            cache.unlock(m)
        elif op < 0.85:
            check_match([rng.randrange(3) for _ in range(rng.randint(1, 11))])
        else:
            before = pool.num_free
            assert cache.evict_pages(rng.randint(1, 5)) == pool.num_free - before
        invariants()

    for m, own in active:
        pool.decref(own)
        cache.unlock(m)
    cache.evict_pages(10 ** 6)
    assert pool.num_free == pool.num_total and live == set() and cache.stats()["nodes"] == 0
    assert cache.stats()["hits"] > 0 and cache.stats()["misses"] > 0  # both paths were exercised
