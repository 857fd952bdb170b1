"""Allocators for the two per-request resources of a glm5_next engine: pages of the paged
latent KV cache (shared between requests and the prefix cache, hence reference counted) and
KDA state slots (one owner each, hence a plain free list)."""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable


class OutOfPages(RuntimeError):
    """Raised by `PagePool.alloc` when fewer pages are free than asked for."""


class NoRoom(RuntimeError):
    """No state slot or pages free now for a request that must have them at once (one prefilled
    by another engine, `LLMEngine.reserve_prefilled`): a server answers 503."""


class PagePool:
    """Page ids 0..n_pages-1 with reference counts. A page is free exactly when its count is 0."""

    def __init__(self, n_pages: int):
        if n_pages < 0:
            raise ValueError(f"n_pages must be >= 0, got {n_pages}")
        self._ref = [0] * n_pages
        # Stack reversed so early allocations get low ids: keeps debugging output readable.
        self._free = list(range(n_pages - 1, -1, -1))

    @property
    def num_total(self) -> int:
        return len(self._ref)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._ref) - len(self._free)

    def refcount(self, page: int) -> int:
        self._check_id(page)
        return self._ref[page]

    def alloc(self, n: int) -> list[int]:
        """n fresh pages with count 1; all-or-nothing so a failed request leaks nothing."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free of {len(self._ref)}")
        out = [self._free.pop() for _ in range(n)]
        for p in out:
            self._ref[p] = 1
        return out

    def incref(self, pages: Iterable[int]) -> None:
        """Share already-allocated pages; sharing a free page would be a use-after-free."""
        counts = Counter(pages)
        for p in counts:
            self._check_id(p)
            if self._ref[p] == 0:
                raise ValueError(f"incref of free page {p}")
        for p, c in counts.items():
            self._ref[p] += c

    def decref(self, pages: Iterable[int]) -> list[int]:
        """Drop references; returns the pages that went back to the free list.
        Validated before mutating so a bad call leaves the pool unchanged."""
        counts = Counter(pages)
        for p, c in counts.items():
            self._check_id(p)
            if self._ref[p] < c:
                raise ValueError(f"decref of page {p} below zero (count {self._ref[p]}, dropping {c})")
        freed = []
        for p, c in counts.items():
            self._ref[p] -= c
            if self._ref[p] == 0:
                freed.append(p)
        self._free.extend(freed)
        return freed

    def _check_id(self, page: int) -> None:
        if not 0 <= page < len(self._ref):
            raise IndexError(f"page id {page} out of range [0, {len(self._ref)})")


class SlotPool:
    """KDA state slots: each belongs to at most one running request, so no refcounts."""

    def __init__(self, n_slots: int):
        if n_slots < 0:
            raise ValueError(f"n_slots must be >= 0, got {n_slots}")
        self._n = n_slots
        self._free = list(range(n_slots))   # a min-heap: the lowest free slot goes first, so the
        self._in_use = [False] * n_slots     # running set stays a dense range and KDA states need no gather

    @property
    def num_total(self) -> int:
        return self._n

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        """A free slot, or None: running out of slots is a scheduling limit, not an error."""
        if not self._free:
            return None
        s = heapq.heappop(self._free)
        self._in_use[s] = True
        return s

    def free(self, slot: int) -> None:
        if not 0 <= slot < self._n:
            raise IndexError(f"slot {slot} out of range [0, {self._n})")
        if not self._in_use[slot]:
            raise ValueError(f"double free of slot {slot}")
        self._in_use[slot] = False
        heapq.heappush(self._free, slot)
