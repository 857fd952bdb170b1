"""Output constraints of an engine's requests (`constrain`: forced prefixes and grammar bitmasks,
applied to their own rows only), and structured-output requests before they run: each request's grammar compiles on
the `GrammarBook`'s thread while the engine steps on; a request joins the scheduler once its
grammar is ready (`ready`), so the batch never waits on a compile, only that request does."""

from __future__ import annotations

import torch

from ..measure.spans import span
from .structured import Constraint, GrammarBook


class GrammarQueue:
    def __init__(self, tokenizer, config, model_dir=None):
        """tokenizer: the engine's, else read from `model_dir` at the first structured request
        (a server's engine process detokenizes nothing and has none of its own)."""
        self.tokenizer, self.config, self.model_dir = tokenizer, config, model_dir
        self.book: GrammarBook | None = None
        self.waiting: dict = {}            # request id -> (request, future)

    def add(self, req) -> None:
        if self.tokenizer is None and self.model_dir is not None:
            from ..models.resolve import load_tokenizer
            self.tokenizer = load_tokenizer(self.model_dir)
        if self.tokenizer is None:
            raise ValueError("structured outputs need the checkpoint's tokenizer; this engine has none")
        if self.book is None:
            self.book = GrammarBook(self.tokenizer, self.config.vocab_size, self.config.eos_token_ids)
        self.waiting[req.request_id] = (req, self.book.submit(req.params.structured))

    def ready(self) -> tuple[list, list]:
        """(requests whose grammar compiled, each with its constraint; (request, error) of the rest done)."""
        done, failed = [], []
        for rid, (req, fut) in list(self.waiting.items()):
            if not fut.done():
                continue
            del self.waiting[rid]
            try:
                req.constraint = Constraint(fut.result(), req.params.structured.get("after"))
                done.append(req)
            except ValueError as e:
                failed.append((req, str(e)))
        return done, failed

    def abort(self, rid: str) -> bool:
        got = self.waiting.pop(rid, None)
        if got is not None:
            got[1].cancel()
        return got is not None

    @staticmethod
    def writes(reqs) -> bool:
        """Whether `constrain` writes into the logits of these requests (a forced prefix or a grammar)."""
        return any(r.constraint is not None or r.params.forced_prefix_ids for r in reqs)

    def constrain(self, logits, reqs) -> list[int]:
        """Rows [k] of `logits` for `reqs[k]`: a forced prefix leaves only its next id; an active
        grammar its allowed tokens (the other rows untouched). Returns the rows left with no token
        at all (a forced id the grammar refuses): nothing can be sampled from them."""
        if not self.writes(reqs):
            return []
        for k, r in enumerate(reqs):
            forced = r.params.forced_prefix_ids
            if forced and len(r.output_ids) < len(forced):
                tok = forced[len(r.output_ids)]
                if tok >= logits.shape[1]:
                    raise ValueError(f"forced prefix id {tok} is outside the vocabulary")
                keep = logits[k, tok].clone()
                logits[k].fill_(float("-inf"))
                logits[k, tok] = keep
        if self.book is not None and any(r.constraint is not None for r in reqs):
            with span("grammar mask", cat="mask"):
                self.book.mask(logits, [r.constraint for r in reqs])
        return torch.isneginf(logits).all(dim=-1).nonzero().flatten().tolist()

    def __len__(self) -> int:
        return len(self.waiting)
