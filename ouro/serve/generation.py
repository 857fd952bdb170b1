"""One HTTP request's generation: its n choices sent to the engine, their outputs detokenised
(`IncrementalDetokenizer.update`, as offline; stop strings end a choice here and abort it in the engine), metrics recorded, and everything
aborted if the client goes away."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

from ..engine.detokenizer import IncrementalDetokenizer
from ..measure.spans import span
from .engine_client import EngineUnavailable
from .protocol import ServeError


@dataclass
class Choice:
    index: int
    rid: str
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)        # (token id, logprob, top [(id, lp)] | None)
    prompt_logprobs: list | None = None                  # params.prompt_logprobs: [None, [[id, lp], ...], ...]
    prompt_ranks: list | None = None                     # ... and each prompt token's rank
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    last_token_at: float | None = None


@dataclass
class ChoiceDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list
    finish_reason: str | None


_ids = itertools.count()


class Generation:
    def __init__(self, client, metrics, tokenizer, prompt_ids: list[int], child_params: list, stop: list[str],
                 skip_special_tokens: bool, arrival: float | None = None, images: list | None = None):
        self.client, self.metrics, self.prompt_ids, self.images = client, metrics, prompt_ids, images
        self.params = child_params
        base = f"{next(_ids)}-{int(time.time() * 1000) % 10**8}"
        self.choices = [Choice(i, f"r{base}-{i}", IncrementalDetokenizer(tokenizer, prompt_ids, stop, skip_special_tokens))
                        for i in range(len(child_params))]
        self.by_rid = {c.rid: c for c in self.choices}
        self.arrival = arrival or time.monotonic()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cached_tokens = 0
        self.first_token_at: float | None = None

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    async def start(self) -> None:
        try:
            for c, p in zip(self.choices, self.params):
                await self.client.add(c.rid, self.prompt_ids, p, self.queue, images=self.images)
        except EngineUnavailable as e:
            await self.abort()
            raise ServeError(503, str(e)) from None
        self.metrics.prompt_tokens.inc(len(self.prompt_ids))

    async def deltas(self):
        """Yields ChoiceDelta as outputs arrive, until every choice has finished."""
        while not self.done:
            item = await self.queue.get()
            c = self.by_rid.get(item["rid"])
            if c is None or c.finish_reason is not None:
                continue
            if "error" in item:
                await self.abort()
                raise ServeError(item["status"], item["error"])
            yield self._apply(c, item)

    @span("detokenize", cat="detokenize")
    def _apply(self, c: Choice, item: dict) -> ChoiceDelta:
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
            self.metrics.ttft.observe(now - self.arrival)
        if c.last_token_at is None:               # this choice's first output
            if "prompt_logprobs" in item:
                c.prompt_logprobs, c.prompt_ranks = item["prompt_logprobs"], item["prompt_ranks"]
            if item.get("queue_time") is not None:
                self.metrics.queue.observe(item["queue_time"])
            self.cached_tokens = max(self.cached_tokens, item.get("cached_tokens", 0))
        if c.last_token_at is not None:
            self.metrics.itl.observe(now - c.last_token_at)
        c.last_token_at = now
        ids = item["new_token_ids"]
        stop_token = item["finished"] and item["finish_reason"] == "stop" and isinstance(item["stop_reason"], int)
        text, used = c.detok.update(ids, stop_token=stop_token, finished=item["finished"])
        new_ids = ids[:used]
        new_lp = [(tok, item["logprobs"][k], item["top_logprobs"][k]) for k, tok in enumerate(new_ids)]
        if c.detok.stopped:                      # a stop string: this choice ends here, and in the engine
            c.finish_reason, c.stop_reason = "stop", c.detok.stop_reason
            if not item["finished"]:
                asyncio.ensure_future(self.client.abort(c.rid))
            else:
                self.client.release(c.rid)
        elif item["finished"]:
            c.finish_reason, c.stop_reason = item["finish_reason"], item["stop_reason"]
            self.client.release(c.rid)
        c.token_ids += new_ids
        c.logprobs += new_lp
        self.metrics.generation_tokens.inc(len(new_ids))
        if c.finish_reason is not None:
            self.metrics.finish(c.finish_reason)
            if self.done:
                self.metrics.e2e.observe(now - self.arrival)
                self.metrics.cached_tokens.inc(self.cached_tokens)
        return ChoiceDelta(c.index, text, new_ids, new_lp, c.finish_reason)

    async def abort(self) -> None:
        """Abort every unfinished choice in the engine (client gone, error, shutdown)."""
        for c in self.choices:
            if c.finish_reason is None:
                c.finish_reason = "abort"
                await self.client.abort(c.rid)
