"""Turn a scheduled batch into one model call: the flat batch (cu_seqlens, positions, page
tables, state-slot indices), KDA checkpoint save/restore, and the logits of each sequence's
last new token."""

from __future__ import annotations

import torch

from ..layers.context import ForwardContext, ModelCache
from .memory import MemoryPlan
from .scheduler import ScheduledBatch


class CheckpointStore:
    """KDA states (conv window + recurrent state of every KDA layer) saved at page boundaries."""

    def __init__(self, cache: ModelCache, n: int):
        self.cache = cache
        self.conv = cache.conv.new_zeros(cache.conv.shape[0], n, *cache.conv.shape[2:])
        self.recurrent = cache.recurrent.new_zeros(cache.recurrent.shape[0], n, *cache.recurrent.shape[2:])
        self.free_ids = list(range(n - 1, -1, -1))

    def save(self, slot: int) -> int | None:
        if not self.free_ids:
            return None
        i = self.free_ids.pop()
        self.conv[:, i] = self.cache.conv[:, slot]
        self.recurrent[:, i] = self.cache.recurrent[:, slot]
        return i

    def restore(self, i: int, slot: int) -> None:
        self.cache.conv[:, slot] = self.conv[:, i]
        self.cache.recurrent[:, slot] = self.recurrent[:, i]

    def release(self, i: int) -> None:
        assert i not in self.free_ids, f"checkpoint {i} freed twice"
        self.free_ids.append(i)


class ModelRunner:
    def __init__(self, model, plan: MemoryPlan, device="cpu"):
        self.model = model
        self.device = device
        dtype = model.embed_tokens.weight.dtype
        self.cache = ModelCache(model.config, plan.n_slots, plan.n_pages, plan.page_size, dtype=dtype, device=device)
        self.checkpoints = CheckpointStore(self.cache, plan.n_checkpoints) if plan.n_checkpoints else None

    @torch.inference_mode()  # no autograd bookkeeping at all: cheaper per op than no_grad
    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Compute the batch's new tokens; returns float32 logits [B, V] of each last new token."""
        # batch rows in slot order: with dense slots, KDA layers then update states in place
        order = sorted(range(len(batch.requests)), key=lambda i: batch.requests[i].slot)
        batch.requests = [batch.requests[i] for i in order]
        batch.num_new_tokens = [batch.num_new_tokens[i] for i in order]
        reqs, counts = batch.requests, batch.num_new_tokens
        for r in reqs:
            if r.restore_from is not None:
                self.checkpoints.restore(r.restore_from, r.slot)
                r.restore_from = None
        width = max(len(r.pages) for r in reqs)
        table = torch.tensor([r.pages + [0] * (width - len(r.pages)) for r in reqs], dtype=torch.long)
        ctx = ForwardContext.build(self.cache, counts, [r.num_computed for r in reqs], [r.slot for r in reqs], table)
        ids = [t for r, n in zip(reqs, counts) for t in r.all_ids[r.num_computed: r.num_computed + n]]
        logits = self.model(torch.tensor(ids, device=self.device), ctx)
        for r, n in zip(reqs, counts):
            r.num_computed += n
        return logits.float().cpu()  # sampling runs on the CPU with per-request CPU generators
