"""Prefix caching's KDA checkpoints for an `LLMEngine`: saved at page boundaries while a prompt
is computed, inserted into the prefix tree with the prompt's full pages once it is, released if
the request goes first. `self` is the engine."""

from __future__ import annotations


def checkpoint_batch(self, batch) -> None:
    """KDA checkpoints at page boundaries of the batch's prompts, inserted once a prompt is computed."""
    if self.prefix_cache is None:
        return
    ps = self.config.page_size
    for r, count in zip(batch.requests, batch.num_new_tokens):
        if r.num_computed - count >= len(r.prompt_ids):
            continue                      # a decode step: the prompt is already in the tree
        pending = self._pending_ckpt.setdefault(r.request_id, {})
        n = r.num_computed
        if n % ps == 0 and n <= len(r.prompt_ids) and n not in pending and self.prefix_cache.should_checkpoint(n):
            ckpt = self.runner.checkpoints.save(r.slot)
            if ckpt is not None:
                pending[n] = ckpt
        if n >= len(r.prompt_ids) and r.request_id in self._pending_ckpt:
            full = len(r.prompt_ids) // ps
            pending = self._pending_ckpt.pop(r.request_id)
            rejected = self.prefix_cache.insert(r.key_ids[: full * ps], r.pages[:full], pending)
            for c in rejected:
                self.runner.checkpoints.release(c)


def drop_checkpoints(self, r) -> None:
    for c in self._pending_ckpt.pop(r.request_id, {}).values():
        self.runner.checkpoints.release(c)
