"""A sampled token's way out of the engine, the same for every path that produces one (a step's
sampler, speculative verification, a request prefilled by another worker): appended with its
logprobs, detokenised where the engine has a tokenizer (stop strings end the request here), checked
for a stop (EOS, stop token ids, a complete grammar, `max_tokens`, the model's length), and
reported as a `RequestOutput`. It says why a request stops; the engine lets it go (`LLMEngine.emit`).
A served engine has no tokenizer: the server makes each choice's text with the same
`IncrementalDetokenizer.update` (`serve/generation.py`), so the text rules are one piece of code."""

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
        if r.constraint is not None:
            r.constraint.accept(tok)
        by_token = self.stops_on(r, tok)
        later = self.ends_after(r)
        new_text = ""
        if r.detokenizer is not None:
            new_text = r.detokenizer.update([tok], stop_token=by_token, finished=later is not None)[0]
        if by_token:
            r.stop_reason = tok
            return new_text, "stop"
        if r.detokenizer is not None and r.detokenizer.stopped:
            r.stop_reason = r.detokenizer.stop_reason
            return new_text, "stop"
        return new_text, later

    def stops_on(self, r: Request, tok: int) -> bool:
        """Whether `tok` ends the request by its id (EOS, a stop token id): it is kept out of the text."""
        p = r.params
        return (not p.ignore_eos and tok in self.eos_token_ids) or bool(p.stop_token_ids and tok in p.stop_token_ids)

    def ends_after(self, r: Request) -> str | None:
        """Why the request ends after its last token, by neither its id nor a stop string: a
        complete grammar ("stop": nothing more may follow), `max_tokens` or the model's length."""
        if r.constraint is not None and r.constraint.done:
            return "stop"
        if len(r.output_ids) >= r.params.max_tokens or r.num_tokens >= self.max_model_len:
            return "length"
        return None

    @staticmethod
    def output(r: Request, new_ids, new_text) -> RequestOutput:
        text = r.detokenizer.text if r.detokenizer else ""
        return RequestOutput(r.request_id, new_ids, new_text, list(r.output_ids), text, r.is_finished,
                             r.finish_reason, r.stop_reason, r.prompt_ids, r.cached_tokens,
                             list(r.logprobs), list(r.top_logprobs),
                             None if r.first_scheduled is None else r.first_scheduled - r.arrival,
                             r.prompt_logprobs, r.prompt_ranks)
