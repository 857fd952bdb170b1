"""A sampled token's way out of the engine, the same for every path that produces one (a step's
sampler, speculative verification, a request prefilled by another worker): appended with its
logprobs, detokenised where the engine has a tokenizer (stop strings end the request here), checked
for a stop (EOS, stop token ids, a complete grammar, `max_tokens`, the model's length), and
reported as a `RequestOutput`. It says why a request stops; the engine lets it go (`LLMEngine.emit`). A served engine has no tokenizer: the server detokenises the ids
with the same `IncrementalDetokenizer` (`serve/generation.py`)."""

from __future__ import annotations

from .request import Request, RequestOutput


class OutputProcessor:
    def __init__(self, eos_token_ids, max_model_len: int):
        self.eos_token_ids, self.max_model_len = eos_token_ids, max_model_len
        self.logits_history: dict[str, list] = {}      # request id -> logits of each token (record_logits)

    def emit(self, r: Request, tok: int, logprob, top, logits_row=None) -> tuple[str, str | None]:
        """One output token: appended, detokenised, checked for a stop; returns the new text and
        why the request stops ("stop", "length"; None: it goes on)."""
        if logits_row is not None:
            self.logits_history.setdefault(r.request_id, []).append(logits_row.clone())
        r.output_ids.append(tok)
        r.logprobs.append(logprob)
        r.top_logprobs.append(top)
        new_text = r.detokenizer.add(tok) if r.detokenizer else ""
        if r.constraint is not None:
            r.constraint.accept(tok)
        reason = self.stop_reason(r, tok)
        if reason and r.detokenizer is not None:
            # text held back as a possible stop-string start is released unless a stop string matched
            new_text += r.detokenizer.flush()
        return new_text, reason

    def stop_reason(self, r: Request, tok: int) -> str | None:
        """Why `tok` ends the request, or None (a stop by token or string is kept in `r.stop_reason`)."""
        p = r.params
        reason = None
        if not p.ignore_eos and tok in self.eos_token_ids:
            reason, r.stop_reason = "stop", tok
        elif p.stop_token_ids and tok in p.stop_token_ids:
            reason, r.stop_reason = "stop", tok
        elif r.detokenizer is not None and r.detokenizer.stopped:
            reason, r.stop_reason = "stop", r.detokenizer.stop_reason
        elif r.constraint is not None and r.constraint.done:    # the grammar is complete: nothing more may follow
            reason = "stop"
        elif len(r.output_ids) >= p.max_tokens or r.num_tokens >= self.max_model_len:
            reason = "length"
        return reason

    @staticmethod
    def output(r: Request, new_ids, new_text) -> RequestOutput:
        text = r.detokenizer.text if r.detokenizer else ""
        return RequestOutput(r.request_id, new_ids, new_text, list(r.output_ids), text, r.is_finished,
                             r.finish_reason, r.stop_reason, r.prompt_ids, r.cached_tokens,
                             list(r.logprobs), list(r.top_logprobs),
                             None if r.first_scheduled is None else r.first_scheduled - r.arrival,
                             r.prompt_logprobs, r.prompt_ranks)
