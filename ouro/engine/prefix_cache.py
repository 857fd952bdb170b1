"""Prefix cache for hybrid DSA + KDA models: a trie over full KV pages of token ids, plus
KDA-state checkpoints pinned to page boundaries.

Why checkpoints: DSA layers can reuse cached latent KV pages directly, but KDA layers carry a
recurrent state that cannot be rebuilt from KV. A request may therefore only skip prefill up
to a boundary where a KDA state snapshot (checkpoint) exists; a longer KV hit is clamped."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .page_pool import PagePool


class _Node:
    __slots__ = ("key", "page", "parent", "children", "depth", "checkpoint",
                 "last_access", "ckpt_access", "lock_ref", "alive")

    def __init__(self, key: tuple, page: int, parent: _Node | None, depth: int):
        self.key = key
        self.page = page
        self.parent = parent
        self.children: dict[tuple, _Node] = {}
        self.depth = depth                    # pages from the root; node covers depth*page_size tokens
        self.checkpoint: int | None = None    # KDA state after depth*page_size tokens
        self.last_access = 0
        self.ckpt_access = 0
        self.lock_ref = 0
        self.alive = True                     # False once evicted: catches locking a stale match


@dataclass
class PrefixMatch:
    pages: list[int]                          # cached pages of the longest full-page KV hit
    num_tokens: int                           # len(pages) * page_size
    checkpoint: tuple[int, int] | None        # (tokens, checkpoint_id) the engine resumes from
    usable_tokens: int                        # tokens the request may skip (0 if no checkpoint)
    usable_pages: list[int]                   # pages[:usable_tokens // page_size]
    _nodes: list[_Node] = field(default_factory=list, repr=False, compare=False)
    _locked: bool = field(default=False, repr=False, compare=False)


class PrefixCache:
    def __init__(self, page_size: int, page_pool: PagePool, max_checkpoints: int,
                 on_evict_checkpoint: Callable[[int], None] | None = None,
                 checkpoint_interval: int = 1):
        if page_size <= 0 or checkpoint_interval <= 0 or max_checkpoints < 0:
            raise ValueError("page_size and checkpoint_interval must be > 0, max_checkpoints >= 0")
        self.page_size = page_size
        self.pool = page_pool
        self.max_checkpoints = max_checkpoints
        self.checkpoint_interval = checkpoint_interval
        self._on_evict_ckpt = on_evict_checkpoint or (lambda _cid: None)
        self._root = _Node((), -1, None, 0)
        self._clock = 0                       # logical time for LRU; monotonic, never wall clock
        self._num_nodes = 0
        self._ckpt_nodes: set[_Node] = set()
        self._hits = self._misses = self._served = 0

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _key(self, token_ids: Sequence[int], i: int) -> tuple:
        return tuple(token_ids[i * self.page_size:(i + 1) * self.page_size])

    def should_checkpoint(self, num_tokens: int) -> bool:
        ps = self.page_size
        return num_tokens > 0 and num_tokens % ps == 0 and (num_tokens // ps) % self.checkpoint_interval == 0

    # ---- lookup -------------------------------------------------------------------------
    def match(self, token_ids: Sequence[int], rows_only: bool = False) -> PrefixMatch:
        """The longest cached run of full pages. Usable for a request that computes: up to the
        deepest checkpoint leaving a token to compute. `rows_only` (a decode worker, whose KDA
        state arrives from its prefill worker): every matched page within the prompt is usable."""
        now = self._tick()
        nodes: list[_Node] = []
        node = self._root
        for i in range(len(token_ids) // self.page_size):
            node = node.children.get(self._key(token_ids, i))
            if node is None:
                break
            node.last_access = now
            nodes.append(node)
        # Resume point: deepest checkpoint that still leaves >= 1 prompt token to compute,
        # because the request needs logits for its last prompt token.
        limit = len(token_ids) - 1
        resume = None
        for n in reversed(nodes):
            if n.checkpoint is not None and n.depth * self.page_size <= limit:
                resume = n
                break
        pages = [n.page for n in nodes]
        if rows_only and nodes:
            self._hits += 1
            self._served += len(pages) * self.page_size
            return PrefixMatch(pages, len(pages) * self.page_size, None, len(pages) * self.page_size, pages, nodes)
        if resume is None:
            self._misses += 1
            return PrefixMatch(pages, len(pages) * self.page_size, None, 0, [], nodes)
        resume.ckpt_access = now
        usable = resume.depth * self.page_size
        self._hits += 1
        self._served += usable
        return PrefixMatch(pages, len(pages) * self.page_size, (usable, resume.checkpoint),
                           usable, pages[:resume.depth], nodes)

    def lock(self, match: PrefixMatch) -> None:
        """Pin the usable path (nodes, their checkpoints) and take page references for the request."""
        if match._locked:
            raise ValueError("match already locked")
        used = match._nodes[:len(match.usable_pages)]
        if any(not n.alive for n in used):
            raise ValueError("match is stale: part of it was evicted before lock()")
        now = self._tick()
        for n in used:
            n.lock_ref += 1
            n.last_access = now
        self.pool.incref(match.usable_pages)
        match._locked = True

    def unlock(self, match: PrefixMatch) -> None:
        if not match._locked:
            raise ValueError("match is not locked")
        for n in match._nodes[:len(match.usable_pages)]:
            n.lock_ref -= 1
        self.pool.decref(match.usable_pages)
        match._locked = False

    # ---- insertion ----------------------------------------------------------------------
    def insert(self, token_ids: Sequence[int], pages: Sequence[int],
               checkpoints: dict[int, int] | None = None) -> list[int]:
        """Store full pages and checkpoints; returns checkpoint ids NOT adopted (caller frees)."""
        now = self._tick()
        n_full = min(len(token_ids) // self.page_size, len(pages))
        path: list[_Node] = []
        node = self._root
        for i in range(n_full):
            key = self._key(token_ids, i)
            child = node.children.get(key)
            if child is None:
                # Same tokens => same KV, so an existing page is kept and the caller's is left alone.
                self.pool.incref([pages[i]])
                child = _Node(key, pages[i], node, node.depth + 1)
                node.children[key] = child
                self._num_nodes += 1
            child.last_access = now
            path.append(child)
            node = child
        rejected = []
        # Shallow first, so with a tight bound the deepest (most useful) checkpoints survive.
        for ntok, cid in sorted((checkpoints or {}).items()):
            d, rem = divmod(ntok, self.page_size)
            if rem or d <= 0 or d > n_full or path[d - 1].checkpoint is not None:
                rejected.append(cid)
                continue
            if len(self._ckpt_nodes) >= self.max_checkpoints and not self._evict_one_checkpoint():
                rejected.append(cid)
                continue
            n = path[d - 1]
            n.checkpoint = cid
            n.ckpt_access = self._tick()
            self._ckpt_nodes.add(n)
        return rejected

    # ---- eviction -----------------------------------------------------------------------
    def _drop_checkpoint(self, n: _Node) -> None:
        cid = n.checkpoint
        n.checkpoint = None
        self._ckpt_nodes.discard(n)
        self._on_evict_ckpt(cid)

    def _evict_one_checkpoint(self) -> bool:
        cands = [n for n in self._ckpt_nodes if n.lock_ref == 0]
        if not cands:
            return False
        self._drop_checkpoint(min(cands, key=lambda n: n.ckpt_access))
        return True

    def evict_pages(self, n: int) -> int:
        """Evict LRU unlocked leaves until n pages went back to the pool; returns pages freed.
        A leaf whose page a running request still references is evicted but frees nothing yet."""
        freed = 0
        heap: list[tuple[int, int, _Node]] = []
        seq = 0                               # tie-break so heapq never compares nodes

        def push(node: _Node) -> None:
            nonlocal seq
            if node is not self._root and not node.children and node.lock_ref == 0:
                heapq.heappush(heap, (node.last_access, seq, node))
                seq += 1

        stack = [self._root]
        while stack:
            x = stack.pop()
            stack.extend(x.children.values())
            push(x)
        while freed < n and heap:
            _, _, leaf = heapq.heappop(heap)
            if leaf.checkpoint is not None:
                self._drop_checkpoint(leaf)
            parent = leaf.parent
            del parent.children[leaf.key]
            leaf.alive = False
            leaf.parent = None
            self._num_nodes -= 1
            freed += len(self.pool.decref([leaf.page]))
            push(parent)                      # parent may just have become an evictable leaf
        return freed

    # ---- introspection ------------------------------------------------------------------
    def held_pages(self) -> list[int]:
        out, stack = [], list(self._root.children.values())
        while stack:
            x = stack.pop()
            out.append(x.page)
            stack.extend(x.children.values())
        return out

    def held_checkpoints(self) -> list[int]:
        return [n.checkpoint for n in self._ckpt_nodes]

    def stats(self) -> dict[str, int]:
        return {
            "nodes": self._num_nodes,
            "pages_held": self._num_nodes,    # one page per node
            "checkpoints_held": len(self._ckpt_nodes),
            "hits": self._hits,
            "misses": self._misses,
            "cached_tokens_served": self._served,
        }
