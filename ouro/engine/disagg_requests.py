"""The engine's side of disaggregated serving, as public methods of `LLMEngine` (its base class):
a decode worker's requests arrive prefilled by another engine (`reserve_prefilled`,
`activate_prefilled`, `release_reserved`: `disagg.decode_engine`), a prefill worker's finished
requests are held while their state is sent (`held_request`, `release_held`, `num_held`, and
`running()` for which rows a forward computes: `disagg.prefill_engine`). The transfers read and
write `LLMEngine.cache`."""

from __future__ import annotations

import time

from .detokenizer import IncrementalDetokenizer
from .page_pool import NoRoom, OutOfPages
from .request import Request, RequestOutput, Status
from .sampling import SamplingParams, make_generator


class DisaggRequests:
    def reserve_prefilled(self, request_id: str, ids: list[int], params: SamplingParams, mm=None) -> Request:
        """A state slot and the prompt's pages for a checked request (`check_request`) whose rows
        and KDA state another engine computes and sends; it is not scheduled until
        `activate_prefilled`. The full pages of a prefix this engine's prefix cache holds come first,
        locked: `req.prefix_match.usable_tokens` rows need not be sent. Raises NoRoom, having
        changed nothing, when no slot or pages are free now."""
        slot = self.slots.alloc()
        if slot is None:
            raise NoRoom("no free state slot")
        held = self.prefix_cache.match(mm.key_ids(ids) if mm else ids, rows_only=True) if self.prefix_cache else None
        if held is not None and not held.usable_tokens:
            held = None
        if held is not None:
            self.prefix_cache.lock(held)
        own = held.usable_pages if held is not None else []
        need = -(-len(ids) // self.config.page_size) - len(own)
        try:
            if need > self.pages.num_free and self.prefix_cache is not None:
                self.prefix_cache.evict_pages(need - self.pages.num_free)
            pages = list(own) + self.pages.alloc(need)
        except OutOfPages as err:
            self.slots.free(slot)
            if held is not None:
                self.prefix_cache.unlock(held)
            raise NoRoom(f"no pages: {err}") from None
        n = next(self._ids)
        req = Request(request_id, ids, params, generator=make_generator(params.seed, self.config.seed + n), pages=pages,
                      slot=slot, prefix_match=held, mm=mm)
        if self.tokenizer is not None:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.stop_list, params.skip_special_tokens)
        return req

    def activate_prefilled(self, req: Request, first_token: int, logprob=None, top_logprobs=None,
                           cached_tokens: int = 0) -> RequestOutput:
        """A reserved request whose prompt state has arrived joins the running batch, its prompt
        computed, with `first_token` (sampled by the prefill engine) as its first output."""
        req.num_computed, req.cached_tokens = len(req.prompt_ids), cached_tokens
        if self.prefix_cache is not None:   # its full pages serve later requests' rows here
            full = len(req.prompt_ids) // self.config.page_size
            self.prefix_cache.insert(req.key_ids[: full * self.config.page_size], req.pages[:full], {})
        req.status, req.first_scheduled = Status.RUNNING, time.monotonic()
        self.requests[req.request_id] = req
        self.scheduler.running.append(req)
        return self.outputs.output(req, [first_token], self.emit(req, first_token, logprob, top_logprobs))

    def release_reserved(self, req: Request) -> None:
        """A reserved request that will not be activated: its slot, pages and prefix lock go back."""
        self.scheduler.free(req)

    def held_request(self, request_id: str) -> Request | None:
        """A finished request whose pages and slot are kept (`hold_on_finish`: its state is being sent)."""
        return self.scheduler.held.get(request_id)

    def release_held(self, request_id: str) -> bool:
        """A held request's pages and slot go back (its state was sent, or never will be)."""
        return self.scheduler.release(request_id)

    def num_held(self) -> int:
        return len(self.scheduler.held)

    def running(self) -> list[Request]:
        """The requests the next step computes, besides those waiting (read only)."""
        return list(self.scheduler.running)
