"""The cache's memory budget (`cache_budget`: how much, from where, shared by which ranks), the two
pools sized from it (`plan_memory`), and what limits concurrency, said in one line."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..layers.context import ModelCache
from ..models.loader import device_free_bytes as available_bytes  # noqa: F401  (engine start-up budget)

# On a CPU the default budget is capped like vLLM's CPU backend caps its KV space
# (VLLM_CPU_KVCACHE_SPACE, 4 GiB): OURO_KV_CACHE_SPACE GiB, unless --max-memory says otherwise
# (on a GPU, whose memory is committed when allocated, the cap applies only when the variable is
# set). The cache is allocated untouched (`ModelCache`): on a CPU what is resident follows use.
KV_CACHE_SPACE_ENV = "OURO_KV_CACHE_SPACE"
DEFAULT_KV_CACHE_SPACE = 4 << 30


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def kv_cache_space() -> tuple[int, str]:
    """The cap on a default budget in bytes, and where it came from (OURO_KV_CACHE_SPACE, in GiB)."""
    text = os.environ.get(KV_CACHE_SPACE_ENV, "").strip()
    if not text:
        return DEFAULT_KV_CACHE_SPACE, f"the default cap ({KV_CACHE_SPACE_ENV} unset)"
    try:
        gib = float(text)
    except ValueError:
        gib = -1.0
    if not gib > 0:
        raise ValueError(f"{KV_CACHE_SPACE_ENV} must be a number of GiB > 0 (e.g. 4 or 0.5), got {text!r}")
    return int(gib * 2**30), f"the cap {KV_CACHE_SPACE_ENV}={text}"


def default_budget(device: str = "cpu", fraction: float = 0.5, available: int | None = None) -> tuple[int, str]:
    """The budget when none is given: `fraction` of the memory available now, at most the KV-space
    cap (a CPU's; a GPU's only when OURO_KV_CACHE_SPACE is set). Returns (bytes, where they came
    from). Measure this once per host for everything started together (the ranks of an engine, the
    workers of `serve --disagg`) and divide it among them: processes that each measure see the same
    free memory and would each take their share of it."""
    available = available_bytes(device) if available is None else available
    share = int(fraction * available)
    cap, cap_source = kv_cache_space()
    if str(device) != "cpu" and not os.environ.get(KV_CACHE_SPACE_ENV, "").strip():
        return share, f"{fraction:g} x {_gib(available)} free on {device}"
    if cap <= share:
        return cap, f"{cap_source}, {_gib(cap)}; {fraction:g} x {_gib(available)} available would be {_gib(share)}"
    return share, f"{fraction:g} x {_gib(available)} available, under {cap_source} of {_gib(cap)}"


@dataclass(frozen=True)
class CacheBudget:
    """Bytes for every cache an engine holds on this host, and the ranks that share them."""
    total: int
    ranks: int = 1           # processes that each hold one cache of `per_rank` bytes (tensor-parallel ranks)
    source: str = ""         # where `total` came from, in words

    @property
    def per_rank(self) -> int:
        return self.total // self.ranks

    def describe(self) -> str:
        text = f"budget {_gib(self.total)} ({self.source})"
        if self.ranks > 1:
            text += f", shared by {self.ranks} tensor-parallel ranks: {_gib(self.per_rank)} each"
        return text


def cache_budget(config, available: int | None = None) -> CacheBudget:
    """The engine's one budget (`EngineConfig` `config`): --max-memory, else `default_budget`; its
    tensor-parallel ranks share it (rank 0 plans each rank's cache with `per_rank`; the followers
    build what rank 0 planned and never measure memory themselves)."""
    ranks = config.tensor_parallel_size
    if config.max_memory:
        return CacheBudget(config.max_memory, ranks, "--max-memory")
    total, source = default_budget(config.device, config.memory_fraction, available)
    return CacheBudget(total, ranks, "default: " + source)


@dataclass(frozen=True)
class MemoryPlan:
    page_size: int
    n_pages: int
    n_slots: int
    n_checkpoints: int
    page_bytes: int
    slot_bytes: int
    max_num_seqs: int = 0        # the configured cap on running sequences (0: not known)
    pages_capped: bool = False   # the pages are what max_num_seqs sequences of max_model_len can use, not the budget's
    budget: CacheBudget | None = None

    @property
    def max_tokens(self) -> int:
        return self.n_pages * self.page_size

    @property
    def total_bytes(self) -> int:
        return self.n_pages * self.page_bytes + (self.n_slots + self.n_checkpoints) * self.slot_bytes

    def limit(self, context_len: int) -> str:
        """Which pool caps concurrency for sequences of `context_len` tokens: "pages", "state slots",
        or "max_num_seqs" (there is a slot per allowed sequence, and pages for all of them)."""
        by_pages = self.n_pages // max(1, -(-context_len // self.page_size))
        if self.n_slots < by_pages:
            return "max_num_seqs" if self.n_slots == self.max_num_seqs else "state slots"
        return "pages"

    def describe(self, context_len: int) -> str:
        """The start-up line: the budget and where it came from, both pools, what limits concurrency."""
        by_pages = self.n_pages // max(1, -(-context_len // self.page_size))
        fit = min(self.n_slots, by_pages)
        limit = self.limit(context_len)
        head = f"cache {self.budget.describe()}, " if self.budget is not None else "cache: "
        uses = f"plan uses {_gib(self.total_bytes)}" + (" (pages capped at max_num_seqs x max_model_len)"
                                                   if self.pages_capped else "")
        return (f"{head}{uses}, resident as used: {self.n_pages} pages x {self.page_size} tokens = "
                f"{self.max_tokens} tokens ({self.n_pages * self.page_bytes / 2**20:.1f} MiB), {self.n_slots} KDA "
                f"state slots ({self.n_slots * self.slot_bytes / 2**20:.1f} MiB), {self.n_checkpoints} prefix "
                f"checkpoints; {fit} concurrent sequences of {context_len} tokens fit, limited by "
                f"{limit}" + (f" ({self.max_num_seqs})" if limit == "max_num_seqs" else ""))


def plan_memory(config: ModelConfig, budget_bytes: int, page_size: int, max_num_seqs: int,
                dtype=torch.float32, checkpoint_fraction: float = 0.0, max_model_len: int | None = None,
                checkpoint_interval: int = 1, kv_kinds: dict | None = None,
                budget: CacheBudget | None = None) -> MemoryPlan:
    """Give the state-slot pool what `max_num_seqs` need (at most half the budget), optionally a
    share for prefix-cache KDA checkpoints, and the rest to pages -- but never more pages than
    `max_num_seqs` sequences of `max_model_len` tokens could use, and never more checkpoints than
    the pages can carry (one per `checkpoint_interval` pages). With a checkpoint share, at least
    one checkpoint is planned if the budget allows, so prefix caching never silently turns off.
    `budget`: where `budget_bytes` (one rank's share of it) came from, for the start-up line."""
    page_bytes = page_size * ModelCache.bytes_per_token(config, dtype, kv_kinds)
    slot_bytes = ModelCache.bytes_per_slot(config)
    n_slots = max(1, min(max_num_seqs, budget_bytes // 2 // max(slot_bytes, 1)))
    page_cap = max_num_seqs * -(-max_model_len // page_size) if max_model_len else None

    def pages_for(n_ckpt: int) -> int:
        rest = budget_bytes - (n_slots + n_ckpt) * slot_bytes
        if not page_bytes:
            # no layer keeps per-token rows (every layer linear attention): pages cost nothing, and
            # as many as max_num_seqs sequences of the longest context use are planned
            longest = max_model_len or config.max_position_embeddings
            return page_cap if page_cap is not None else max_num_seqs * -(-longest // page_size)
        n = max(0, rest // page_bytes)
        return n if page_cap is None else min(n, page_cap)

    n_ckpt = 0
    if checkpoint_fraction > 0:
        n_ckpt = max(1, int(budget_bytes * checkpoint_fraction) // max(slot_bytes, 1))
        n_ckpt = min(n_ckpt, pages_for(n_ckpt) // checkpoint_interval)   # what the pages can ever use
    n_pages = pages_for(n_ckpt)
    if n_pages < 1:
        raise ValueError(f"memory budget {budget_bytes / 2**20:.1f} MiB is too small for one page "
                         f"({page_bytes} B) and {n_slots} state slots ({slot_bytes} B each); raise --max-memory")
    return MemoryPlan(page_size, int(n_pages), int(n_slots), int(n_ckpt), page_bytes, slot_bytes, max_num_seqs,
                      page_cap is not None and n_pages == page_cap, budget)
