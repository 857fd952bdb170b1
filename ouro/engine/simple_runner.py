"""Drive the model over a fixed set of sequences with contiguous cache pages: the smallest
correct way to run prefill, chunked prefill and decode through `Glm5NextModel.forward`.
Used by `ouro generate` and the model tests; the scheduler-driven engine replaces it for serving."""

from __future__ import annotations

import torch

from ..layers.context import ForwardContext, ModelCache


class SimpleRunner:
    def __init__(self, model, n_seqs: int, max_len: int, page_size: int | None = None, poison: bool = False,
                 kv_kinds: dict | None = None):
        from ..machine.model_forms import apply_to
        cfg = model.config
        self.model = model
        apply_to(model)      # the products the engine runs (tests and probes see the same paths)
        self.page_size = page_size or 4 * cfg.index_kpool
        pages_per_seq = -(-max_len // self.page_size)
        dev = model.embed_tokens.weight.device
        self.cache = ModelCache(cfg, n_seqs, n_seqs * pages_per_seq, self.page_size,
                                dtype=model.embed_tokens.weight.dtype, device=dev, kv_kinds=kv_kinds)
        if poison:
            self.cache.poison()
        self.page_table = torch.arange(n_seqs * pages_per_seq).view(n_seqs, pages_per_seq)
        self.lengths = [0] * n_seqs
        self.max_len = max_len

    def step(self, tokens: list[list[int]], logits: str = "last") -> torch.Tensor:
        """Feed new tokens for some sequences (empty list: skip that sequence this step)."""
        ids = [i for i, t in enumerate(tokens) if t]
        for i in ids:
            if self.lengths[i] + len(tokens[i]) > self.max_len:
                raise ValueError(f"sequence {i} would exceed max_len {self.max_len}")
        ctx = ForwardContext.build(self.cache, [len(tokens[i]) for i in ids], [self.lengths[i] for i in ids],
                                   ids, self.page_table[ids], logits=logits)
        flat = torch.tensor([t for i in ids for t in tokens[i]], device=self.cache.device)
        out = self.model(flat, ctx)
        for i in ids:
            self.lengths[i] += len(tokens[i])
        return out
