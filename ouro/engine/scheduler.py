"""FCFS scheduler: a per-step token budget, chunked prefill (a prompt the next step could take whole is
not cut to fill this one), one decode step for every running request, admission only with both pages
and a KDA state slot, preemption by recompute."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from ..measure.spans import span
from .page_pool import OutOfPages, PagePool, SlotPool
from .request import Request, Status

log = logging.getLogger("ouro.scheduler")


@dataclass
class ScheduledBatch:
    requests: list[Request]
    num_new_tokens: list[int]
    context_parallel: bool = False     # one request's whole prompt, prefilled across the CP ranks

    def __bool__(self):
        return bool(self.requests)


class Scheduler:
    def __init__(self, pages: PagePool, slots: SlotPool, page_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, prefix_cache=None, chunk_align: int = 0, cp_threshold: int = 0):
        self.pages, self.slots, self.page_size = pages, slots, page_size
        self.cp_threshold = cp_threshold      # > 0: fresh prompts this long are prefilled whole across CP ranks
        self.max_num_seqs, self.token_budget = max_num_seqs, max_num_batched_tokens
        self.prefix_cache = prefix_cache
        self.chunk_align = chunk_align        # end prefill chunks on multiples of this (checkpoint boundaries)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.held: dict[str, Request] = {}    # finished, but their pages and slot are still being read
        self.slot_limited_steps = 0           # steps where a free slot, not pages, blocked admission
        self.num_preemptions = 0

    # ---- bookkeeping ----
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def free(self, req: Request) -> None:
        """Return everything the request holds. Safe to call twice."""
        if req.pages:
            own = req.pages[len(req.prefix_match.usable_pages):] if req.prefix_match else req.pages
            if own:
                self.pages.decref(own)
            req.pages = []
        if req.prefix_match is not None:
            self.prefix_cache.unlock(req.prefix_match)
            req.prefix_match = None
        if req.slot is not None:
            self.slots.free(req.slot)
            req.slot = None

    def finish(self, req: Request, reason: str) -> None:
        """The request leaves the queues. Its pages and slot are returned now, or, for a request
        marked `hold_on_finish` (a disaggregated prefill whose state is still being sent), kept
        in `held` until `release`."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.hold_on_finish and (req.pages or req.slot is not None):
            self.held[req.request_id] = req
        else:
            self.free(req)
        req.status = Status.FINISHED
        req.finish_reason = reason

    def release(self, request_id: str) -> bool:
        """Return a held request's pages and slot (its state has been sent, or will never be)."""
        req = self.held.pop(request_id, None)
        if req is not None:
            self.free(req)
        return req is not None

    def preempt(self, req: Request) -> None:
        """Recompute later: drop its cache, keep its tokens (prompt + outputs so far)."""
        self.running.remove(req)
        self._requeue(req)
        req.num_preemptions += 1
        self.num_preemptions += 1
        log.info("preempted %s (pages exhausted)", req.request_id)

    def reset(self, req: Request) -> None:
        """Forget whatever the request has computed (its cache may be half-written) and queue it
        at the front to recompute: a failed step never leaves a state to be resumed."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._requeue(req)

    def _requeue(self, req: Request) -> None:
        self.free(req)
        req.num_computed = 0
        req.cached_tokens = 0
        req.restore_from = None
        req.draft_ids, req.draft_probs, req.spec_record = [], None, None
        req.status = Status.PREEMPTED
        self.waiting.appendleft(req)

    def grow(self, req: Request, upto_tokens: int) -> bool:
        """Pages for `upto_tokens` tokens (evicting cached prefixes if needed); False if they cannot be had."""
        return self._grow(req, upto_tokens)

    def _grow(self, req: Request, upto_tokens: int) -> bool:
        need = -(-upto_tokens // self.page_size) - len(req.pages)
        if need <= 0:
            return True
        try:
            req.pages += self.pages.alloc(need)
            return True
        except OutOfPages:
            if self.prefix_cache is not None and self.prefix_cache.evict_pages(need - self.pages.num_free) > 0:
                return self._grow(req, upto_tokens)
            return False

    def _chunk(self, req: Request, budget: int) -> int:
        if req.draft_ids and req.num_tokens - req.num_computed == 1:   # the pending token and its drafts
            del req.draft_ids[max(0, budget - 1):]
            return min(1 + len(req.draft_ids), budget)
        n = min(req.num_tokens - req.num_computed, budget)
        end = req.num_computed + n
        if self.chunk_align:  # stop at the last checkpoint boundary the chunk would cross
            aligned = end // self.chunk_align * self.chunk_align - req.num_computed
            if aligned > 0:
                n = aligned
            elif end < req.num_tokens:
                n = 0                        # not even one boundary fits in the budget: wait
        return max(n, 0)

    # ---- one step ----
    def wants_cp(self, req: Request) -> bool:
        """A fresh prompt of at least the threshold (no prefix hit: the ranks start from zero;
        no prompt logprobs: only the last token's logits come back)."""
        return bool(self.cp_threshold) and req.num_computed == 0 and req.num_tokens >= self.cp_threshold \
            and req.params.prompt_logprobs is None and req.mm is None     # image rows stay on this rank

    def _schedule_cp(self) -> ScheduledBatch | None:
        """The first waiting request's whole prompt, alone in its step (running requests wait
        one step), when a slot and all its pages are free. None: schedule as usual."""
        req = self.waiting[0]
        if len(self.running) >= self.max_num_seqs or self.slots.num_free == 0:
            return None
        if not self._grow(req, req.num_tokens):
            self.free(req)
            return None
        self._admit(req)
        return ScheduledBatch([req], [req.num_tokens], context_parallel=True)

    def _admit(self, req: Request) -> None:
        """The first waiting request starts running (its pages already grown): it gets a slot."""
        self.waiting.popleft()
        req.slot = self.slots.alloc()
        req.status = Status.RUNNING
        if req.first_scheduled is None:
            req.first_scheduled = time.monotonic()
        self.running.append(req)

    @span("schedule", cat="schedule")
    def schedule(self) -> ScheduledBatch:
        if self.waiting and self.wants_cp(self.waiting[0]):
            batch = self._schedule_cp()
            if batch is not None:
                return batch
        budget = self.token_budget
        batch = ScheduledBatch([], [])
        preempted_before = self.num_preemptions
        for req in list(self.running):
            if req not in self.running:      # preempted below to make room
                continue
            n = self._chunk(req, budget)
            if n == 0:
                continue
            while not self._grow(req, req.num_computed + n):
                victim = self.running[-1]    # latest arrival gives way
                self.preempt(victim)
                if victim is req:
                    break
            if req.status is Status.RUNNING:
                batch.requests.append(req)
                batch.num_new_tokens.append(n)
                budget -= n
        # what the next step will give the requests running now, at least: what they take in this one
        # (a decode row each, drafts included), and a row for each prompt admitted below
        held_back = self.token_budget - budget
        # no admission in a step that had to preempt: the freed pages went to the running requests
        while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
               and self.num_preemptions == preempted_before):
            req = self.waiting[0]
            if self.slots.num_free == 0:
                if self.slot_limited_steps == 0:
                    log.warning("admission is limited by KDA state slots (%d), not pages (%d free): "
                                "raise --max-memory or lower the context to run more sequences",
                                self.slots.num_total, self.pages.num_free)
                self.slot_limited_steps += 1
                break
            # a request asking for prompt logprobs needs the logits of every prompt position: no hit
            if (self.prefix_cache is not None and req.num_computed == 0 and req.prefix_match is None
                    and req.params.prompt_logprobs is None):
                self._attach_prefix(req)
            n = self._chunk(req, budget)
            left = req.num_tokens - req.num_computed
            # a prompt that the next step could take whole (beside what the running requests take) is not
            # cut to fill this one's leftover budget: its first token would wait a step for the tail, and
            # every row of this step for its head. A prompt no step could take whole is cut as before, and
            # a cut at a checkpoint boundary (`chunk_align`) is no such cut: it happens in any step
            fragment = budget < left <= self.token_budget - held_back     # (never in a step with nothing else)
            if n == 0 or fragment or not self._grow(req, req.num_computed + n):
                # a request that is not running holds nothing: its prefix references would
                # keep pages from the running requests (and they could then only preempt themselves)
                self._detach_prefix(req)
                break
            self._admit(req)
            batch.requests.append(req)
            batch.num_new_tokens.append(n)
            budget -= n
            held_back += 1
        return batch

    def _detach_prefix(self, req: Request) -> None:
        if req.prefix_match is not None:
            self.free(req)
            req.num_computed = req.cached_tokens = 0
            req.restore_from = None

    def _attach_prefix(self, req: Request) -> None:
        m = self.prefix_cache.match(req.key_ids)
        if m.usable_tokens > 0:
            self.prefix_cache.lock(m)
            req.prefix_match = m
            req.pages = list(m.usable_pages)
            req.num_computed = m.usable_tokens
            req.cached_tokens = m.usable_tokens
            req.restore_from = m.checkpoint[1]
