"""Engine outputs -> OpenAI objects: completion / chat.completion objects and their stream chunks,
for the jobs `request_jobs.py` made. Streamed chunks concatenate to exactly the non-streamed object
(one code path builds both).

The prompt's own logprobs (the engine's `prompt_logprobs`) serve two fields: a completion's
`echo` (the prompt's text before the completion's, its tokens first in `logprobs`, the first
token's logprob null: what lm-eval's loglikelihood requests read) and vLLM's `prompt_logprobs`
(`[null, {id: {logprob, rank, decoded_token}}, ...]`, on each completion choice, at the top of a
chat completion)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .request_jobs import Job


def _json(logprob: float) -> float:
    """-inf (a token a forced tool-call tag ruled out) as vLLM writes it: JSON has no infinity."""
    return max(logprob, -9999.0)


def _top(pairs, chosen: int) -> list:
    """A prompt position's [id, logprob] pairs (the prompt token's and the top k) best first, the
    prompt token after the tokens it ties with: the first k are the top k."""
    return sorted(pairs, key=lambda p: (-p[1], p[0] == chosen))


@dataclass
class _ChoiceView:
    index: int
    parser: object = None
    job: Job | None = None
    text: str = ""
    started: bool = False
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)


class ResponseView:
    """Builds the response object (or its chunks) of one request from its generations."""

    def __init__(self, state, body, jobs, gens, rid: str, chat: bool):
        self.state, self.body, self.jobs, self.gens, self.id, self.chat = state, body, jobs, gens, rid, chat
        self.created = int(time.time())
        self.views = {}
        for j, g in zip(jobs, gens):
            for c in g.choices:
                self.views[(id(g), c.index)] = _ChoiceView(j.choice_base + c.index,
                                                           j.parser_factory() if j.parser_factory else None, j)
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)

    # ---- shared pieces ----
    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.state.model_name}

    def usage(self) -> dict:
        prompt = sum(len(j.prompt_ids) for j in self.jobs)
        completion = sum(len(c.token_ids) for g in self.gens for c in g.choices)
        cached = sum(g.cached_tokens for g in self.gens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _logprobs(self, entries, offset: int):
        if not entries:
            return None
        tok = self.state.tokenizer
        as_ids = self.body.return_tokens_as_token_ids
        if self.chat:
            def entry(t, lp):
                text = f"token_id:{t}" if as_ids else tok.decode([t], skip_special_tokens=False)
                return {"token": text, "logprob": _json(lp), "bytes": list(text.encode())}
            return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in (top or [])]}
                                for t, lp, top in entries]}
        name = (lambda t: f"token_id:{t}") if as_ids else (lambda t: tok.decode([t]))
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, lp, top in entries:
            s = name(t)
            out["tokens"].append(s)
            out["token_logprobs"].append(None if lp is None else _json(lp))
            out["top_logprobs"].append({name(i): _json(v) for i, v in (top or [])} or None)
            out["text_offset"].append(offset)
            offset += len(tok.decode([t]))
        return out

    def _prompt_entries(self, c, prompt_ids) -> list:
        """Echo's logprob entries of the prompt's tokens, (id, logprob, top k): the first has none."""
        k, lps = self.body.logprobs, c.prompt_logprobs or [None] * len(prompt_ids)
        out = [(prompt_ids[0], None, None)]
        for t, pairs in zip(prompt_ids[1:], lps[1:]):
            lp = None if pairs is None else next(v for i, v in pairs if i == t)
            out.append((t, lp, _top(pairs, t)[:k] if k and pairs else None))
        return out

    def _vllm_prompt_logprobs(self, c, prompt_ids) -> list | None:
        """vLLM's `prompt_logprobs`: [None, {id: {logprob, rank, decoded_token}}, ...] (the prompt
        token with its rank, then the top k ranked 1..k)."""
        if c.prompt_logprobs is None:
            return None
        k, tok, as_ids = self.body.prompt_logprobs, self.state.tokenizer, self.body.return_tokens_as_token_ids

        def entry(t, lp, rank):
            text = f"token_id:{t}" if as_ids else tok.decode([t], skip_special_tokens=False)
            return {"logprob": _json(lp), "rank": rank, "decoded_token": text}
        out = [None]
        for t, pairs, rank in zip(prompt_ids[1:], c.prompt_logprobs[1:], c.prompt_ranks[1:]):
            d = {t: entry(t, next(v for i, v in pairs if i == t), rank)}
            d.update({i: entry(i, v, r) for r, (i, v) in enumerate(_top(pairs, t)[:k], 1)})
            out.append(d)
        return out

    def _want_logprobs(self) -> bool:
        # chat: logprobs is a bool; completions: an int (0 = only the chosen token's)
        return self.body.logprobs is True if self.chat else self.body.logprobs is not None

    def _finish(self, v: _ChoiceView, reason: str | None) -> str | None:
        if reason is None:
            return None
        if reason == "stop" and self.chat and v.parser is not None and v.parser.has_tool_calls():
            return "tool_calls"
        return reason              # a reply cut by max_tokens says length, a tool call in it or not

    # ---- non-streamed ----
    def final(self) -> dict:
        choices = []
        for g in self.gens:
            for c in g.choices:
                v = self.views[(id(g), c.index)]
                text, entries = c.detok.text, c.logprobs
                if v.job.echo is not None:
                    text = v.job.echo + text
                    entries = self._prompt_entries(c, v.job.prompt_ids) + entries if self._want_logprobs() else []
                lp = self._logprobs(entries, 0) if self._want_logprobs() else None
                if self.chat:
                    msg = v.parser.parse_all(text, c.finish_reason) if v.parser else {"content": text}
                    choices.append({"index": v.index, "message": {"role": "assistant", **msg}, "logprobs": lp,
                                    "finish_reason": self._finish(v, c.finish_reason), "stop_reason": c.stop_reason})
                else:
                    choices.append({"index": v.index, "text": text, "logprobs": lp,
                                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
                    if self.body.prompt_logprobs is not None:
                        choices[-1]["prompt_logprobs"] = self._vllm_prompt_logprobs(c, v.job.prompt_ids)
        choices.sort(key=lambda x: x["index"])
        out = {**self._head("chat.completion" if self.chat else "text_completion"), "choices": choices}
        if self.chat and self.body.prompt_logprobs is not None:    # vLLM's place: the prompt is the choices'
            out["prompt_logprobs"] = self._vllm_prompt_logprobs(self.gens[0].choices[0], self.jobs[0].prompt_ids)
        return {**out, "usage": self.usage()}

    # ---- streamed ----
    def _chunk(self, index: int, delta_or_text, finish=None, logprobs=None, stop_reason=None) -> dict:
        choice = {"index": index, "logprobs": logprobs, "finish_reason": finish}
        if self.chat:
            choice["delta"] = delta_or_text
        else:
            choice["text"] = delta_or_text
        if finish is not None:
            choice["stop_reason"] = stop_reason
        out = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out

    def first_chunks(self):
        if not self.chat:
            return []
        return [self._chunk(v.index, {"role": "assistant", "content": ""}) for v in sorted(
            self.views.values(), key=lambda v: v.index)]

    async def stream_chunks(self):
        import asyncio
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(g):
            try:
                async for d in g.deltas():
                    await queue.put((g, d))
            except Exception as e:   # delivered to the consumer in order
                await queue.put((g, e))
            await queue.put((g, None))
        tasks = [asyncio.ensure_future(pump(g)) for g in self.gens]
        try:
            open_gens = len(self.gens)
            while open_gens:
                g, d = await queue.get()
                if d is None:
                    open_gens -= 1
                    continue
                if isinstance(d, Exception):
                    raise d
                v = self.views[(id(g), d.index)]
                c = g.choices[d.index]
                text, entries = d.text, d.logprobs
                if not v.started:
                    v.started = True
                    if v.job.echo is not None:          # the prompt goes first, with its logprobs
                        text = v.job.echo + text
                        entries = self._prompt_entries(c, v.job.prompt_ids) + entries if self._want_logprobs() else []
                lp = self._logprobs(entries, len(v.text)) if self._want_logprobs() else None
                v.text += text
                if self.chat:
                    deltas = v.parser.feed(d.text) if v.parser else ([{"content": d.text}] if d.text else [])
                    if d.finish_reason is not None and v.parser:
                        deltas += v.parser.finish(c.finish_reason)
                    if lp is not None and not deltas:
                        deltas = [{"content": ""}]
                    for k, delta in enumerate(deltas):
                        yield self._chunk(v.index, delta, None, lp if k == 0 else None)
                    if d.finish_reason is not None:
                        yield self._chunk(v.index, {}, self._finish(v, c.finish_reason), None, c.stop_reason)
                else:
                    if text or lp is not None or d.finish_reason is None:
                        yield self._chunk(v.index, text, None, lp)
                    if d.finish_reason is not None:
                        yield self._chunk(v.index, "", c.finish_reason, None, c.stop_reason)
            if self.include_usage:
                yield {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                       "usage": self.usage()}
        finally:
            for t in tasks:
                t.cancel()
