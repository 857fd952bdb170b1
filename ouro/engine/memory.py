"""Size the cache pools from a memory budget and the model config, and say what limits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..layers.context import ModelCache
from ..models.loader import device_free_bytes as available_bytes  # noqa: F401  (engine start-up budget)


@dataclass(frozen=True)
class MemoryPlan:
    page_size: int
    n_pages: int
    n_slots: int
    n_checkpoints: int
    page_bytes: int
    slot_bytes: int

    @property
    def max_tokens(self) -> int:
        return self.n_pages * self.page_size

    @property
    def total_bytes(self) -> int:
        return self.n_pages * self.page_bytes + (self.n_slots + self.n_checkpoints) * self.slot_bytes

    def limit(self, context_len: int) -> str:
        """Which pool caps concurrency for sequences of `context_len` tokens."""
        by_pages = self.n_pages // max(1, -(-context_len // self.page_size))
        return "state slots" if self.n_slots < by_pages else "pages"

    def describe(self, context_len: int) -> str:
        by_pages = self.n_pages // max(1, -(-context_len // self.page_size))
        fit = min(self.n_slots, by_pages)
        return (f"cache: {self.n_pages} pages x {self.page_size} tokens = {self.max_tokens} tokens "
                f"({self.n_pages * self.page_bytes / 2**20:.1f} MiB), {self.n_slots} KDA state slots "
                f"({self.n_slots * self.slot_bytes / 2**20:.1f} MiB), {self.n_checkpoints} prefix checkpoints; "
                f"{fit} concurrent sequences of {context_len} tokens fit, limited by {self.limit(context_len)}")


def plan_memory(config: ModelConfig, budget_bytes: int, page_size: int, max_num_seqs: int,
                dtype=torch.float32, checkpoint_fraction: float = 0.0, max_model_len: int | None = None,
                checkpoint_interval: int = 1, kv_kinds: dict | None = None) -> MemoryPlan:
    """Give the state-slot pool what `max_num_seqs` need (at most half the budget), optionally a
    share for prefix-cache KDA checkpoints, and the rest to pages -- but never more pages than
    `max_num_seqs` sequences of `max_model_len` tokens could use, and never more checkpoints than
    the pages can carry (one per `checkpoint_interval` pages). With a checkpoint share, at least
    one checkpoint is planned if the budget allows, so prefix caching never silently turns off."""
    page_bytes = page_size * ModelCache.bytes_per_token(config, dtype, kv_kinds)
    slot_bytes = ModelCache.bytes_per_slot(config)
    n_slots = max(1, min(max_num_seqs, budget_bytes // 2 // max(slot_bytes, 1)))
    page_cap = max_num_seqs * -(-max_model_len // page_size) if max_model_len else None

    def pages_for(n_ckpt: int) -> int:
        rest = budget_bytes - (n_slots + n_ckpt) * slot_bytes
        n = max(0, rest // page_bytes) if page_bytes else 0
        return n if page_cap is None else min(n, page_cap)

    n_ckpt = 0
    if checkpoint_fraction > 0:
        n_ckpt = max(1, int(budget_bytes * checkpoint_fraction) // max(slot_bytes, 1))
        n_ckpt = min(n_ckpt, pages_for(n_ckpt) // checkpoint_interval)   # what the pages can ever use
    n_pages = pages_for(n_ckpt)
    if n_pages < 1:
        raise ValueError(f"memory budget {budget_bytes / 2**20:.1f} MiB is too small for one page "
                         f"({page_bytes} B) and {n_slots} state slots ({slot_bytes} B each); raise --max-memory")
    return MemoryPlan(page_size, int(n_pages), int(n_slots), int(n_ckpt), page_bytes, slot_bytes)
