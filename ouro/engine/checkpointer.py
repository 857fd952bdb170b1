"""KDA checkpoints for prefix caching. A KDA layer's state (conv window and recurrent state) cannot
be rebuilt from cached KV rows the way attention can, so a prompt's state is copied aside at page
boundaries while it is computed (`CheckpointStore`), handed to the prefix tree with the prompt's
full pages once it is, and copied back into a request's slot when a later prompt hits that prefix.

`Checkpointer` is the engine's: it decides when (`after_step`, `restore_batch`, `drop`); the
store only copies. Under tensor parallelism every rank keeps its own store of its own shard's
states, and each copy reaches the followers through the rank group (`ranks.checkpoint`)."""

from __future__ import annotations

from ..layers.context import ModelCache


class CheckpointStore:
    """KDA states (conv window + recurrent state of every KDA layer) saved from and restored into
    a cache's state slots; `n` of them, by index."""

    def __init__(self, cache: ModelCache, n: int, ranks=None):
        self.cache = cache
        # uninitialised like the cache (a checkpoint is restored only after it was saved): resident as used
        self.conv = cache.conv.new_empty(cache.conv.shape[0], n, *cache.conv.shape[2:])
        self.recurrent = cache.recurrent.new_empty(cache.recurrent.shape[0], n, *cache.recurrent.shape[2:])
        self.free_ids = list(range(n - 1, -1, -1))
        self.ranks = ranks       # the rank group (`engine.ranks`): followers do the same to their caches

    def save(self, slot: int) -> int | None:
        if not self.free_ids:
            return None
        i = self.free_ids.pop()
        if self.ranks is not None:
            self.ranks.checkpoint("save", slot, i)
        self.save_at(slot, i)
        return i

    def save_at(self, slot: int, i: int) -> None:
        self.conv[:, i] = self.cache.conv[:, slot]
        self.recurrent[:, i] = self.cache.recurrent[:, slot]

    def restore(self, i: int, slot: int) -> None:
        if self.ranks is not None:
            self.ranks.checkpoint("restore", i, slot)
        self.cache.conv[:, slot] = self.conv[:, i]
        self.cache.recurrent[:, slot] = self.recurrent[:, i]

    def release(self, i: int) -> None:
        assert i not in self.free_ids, f"checkpoint {i} freed twice"
        self.free_ids.append(i)


class Checkpointer:
    """When checkpoints are taken, given to the prefix tree, restored and let go, for one engine.
    `store` is None where the memory plan left no room for one (prefix caching is then off)."""

    def __init__(self, store: CheckpointStore | None, page_size: int):
        self.store, self.page_size = store, page_size
        self.prefix_cache = None          # set by the engine once the tree exists (it releases through `store`)
        self.pending: dict[str, dict[int, int]] = {}     # request id -> {prompt length: checkpoint} not yet in the tree

    def restore_batch(self, batch) -> None:
        """Before a step: the states of the batch's prefix hits back into their slots."""
        for r in batch.requests:
            if r.restore_from is not None:
                self.store.restore(r.restore_from, r.slot)
                r.restore_from = None

    def after_step(self, batch) -> None:
        """After a step: checkpoints at page boundaries of the batch's prompts, inserted into the
        prefix tree with the prompt's full pages once the prompt is computed."""
        if self.prefix_cache is None:
            return
        ps = self.page_size
        for r, count in zip(batch.requests, batch.num_new_tokens):
            if r.num_computed - count >= len(r.prompt_ids):
                continue                      # a decode step: the prompt is already in the tree
            pending = self.pending.setdefault(r.request_id, {})
            n = r.num_computed
            if n % ps == 0 and n <= len(r.prompt_ids) and n not in pending and self.prefix_cache.should_checkpoint(n):
                ckpt = self.store.save(r.slot)
                if ckpt is not None:
                    pending[n] = ckpt
            if n >= len(r.prompt_ids) and r.request_id in self.pending:
                full = len(r.prompt_ids) // ps
                pending = self.pending.pop(r.request_id)
                rejected = self.prefix_cache.insert(r.key_ids[: full * ps], r.pages[:full], pending)
                for c in rejected:
                    self.store.release(c)

    def drop(self, r) -> None:
        """A request that ends (or is reset) before its prompt reached the tree: its checkpoints go back."""
        for c in self.pending.pop(r.request_id, {}).values():
            self.store.release(c)

    def free(self) -> int | None:
        """Checkpoints free now (None without a store): what a leak check counts."""
        return None if self.store is None else len(self.store.free_ids)
