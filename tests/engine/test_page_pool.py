import pytest

from ouro.engine.page_pool import OutOfPages, PagePool, SlotPool


def test_alloc_distinct_and_counts():
    pool = PagePool(8)
    assert (pool.num_total, pool.num_free, pool.num_used) == (8, 8, 0)
    a = pool.alloc(3)
    b = pool.alloc(5)
    assert len(set(a + b)) == 8 and set(a + b) == set(range(8))
    assert pool.num_free == 0 and pool.num_used == 8
    assert all(pool.refcount(p) == 1 for p in a + b)
    assert pool.alloc(0) == []


def test_out_of_pages_allocates_nothing():
    pool = PagePool(4)
    pool.alloc(3)
    with pytest.raises(OutOfPages):
        pool.alloc(2)
    assert pool.num_free == 1
    assert len(pool.alloc(1)) == 1
    with pytest.raises(ValueError):
        pool.alloc(-1)


def test_refcounts_return_page_only_at_zero():
    pool = PagePool(4)
    (p,) = pool.alloc(1)
    pool.incref([p, p])
    assert pool.refcount(p) == 3
    assert pool.decref([p]) == []
    assert pool.decref([p]) == []
    assert pool.num_free == 3
    assert pool.decref([p]) == [p]
    assert pool.num_free == 4 and pool.refcount(p) == 0
    # The freed page is handed out again.
    assert p in pool.alloc(4)


def test_decref_free_page_raises_and_is_atomic():
    pool = PagePool(4)
    a, b = pool.alloc(2)
    with pytest.raises(ValueError):
        pool.decref([3])
    # b would go below zero on its second decref: nothing may change, not even a.
    with pytest.raises(ValueError):
        pool.decref([a, b, b])
    assert pool.refcount(a) == 1 and pool.refcount(b) == 1 and pool.num_free == 2
    with pytest.raises(ValueError):
        pool.incref([2])
    with pytest.raises(IndexError):
        pool.decref([99])
    pool.decref([a, b])
    assert pool.num_free == pool.num_total


def test_slot_pool_alloc_free_double_free():
    slots = SlotPool(3)
    got = [slots.alloc() for _ in range(3)]
    assert sorted(got) == [0, 1, 2] and slots.num_free == 0
    assert slots.alloc() is None
    slots.free(got[1])
    assert slots.num_free == 1
    with pytest.raises(ValueError):
        slots.free(got[1])
    with pytest.raises(IndexError):
        slots.free(7)
    assert slots.alloc() == got[1]
    for s in got:
        slots.free(s)
    assert slots.num_free == slots.num_total == 3
