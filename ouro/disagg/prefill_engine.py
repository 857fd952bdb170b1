"""`ouro serve --role prefill`: an `LLMEngine` that prefills requests and sends their state away.

A request arrives with its decode room (`KVReceiver.room_info`). It runs as a one-token request
(the prompt, then the first sampled token), and while it computes, hooks on the built model queue
each decoder layer's new rows to the transfer thread (`KVSender`) as soon as that layer has run, so
sending overlaps the next layers' compute. Its last frame, `done`, carries the first token, its
logprobs and the sampling generator's state (so seeded sampling on the decode side goes on exactly
where it would have). The request's pages and slot stay held here until the transfer thread
says its last frame is out; the engine thread returns them at its next step.
"""

from __future__ import annotations

import base64
import dataclasses
import queue
import time

import torch

from ..engine.request import Request
from .kv_sender import KVSender
from .wake_queue import WakeQueue


def generator_state(gen: torch.Generator | None) -> str | None:
    return None if gen is None else base64.b64encode(gen.get_state().numpy().tobytes()).decode()


def set_generator_state(gen: torch.Generator | None, state: str | None) -> None:
    if gen is not None and state is not None:
        gen.set_state(torch.frombuffer(bytearray(base64.b64decode(state)), dtype=torch.uint8))


class PrefillEngine:
    def __init__(self, engine, timeout_s: float = 30.0, overlap: bool = True):
        """overlap=False: a request's layers are queued only once its prefill is done (the A/B
        that shows what overlapping the transfer with compute buys)."""
        if engine.cp is not None:
            raise ValueError("a prefill worker does not combine with --cp yet")
        self.engine, self.overlap = engine, overlap
        self._deferred: dict[str, list] = {}    # overlap off: each request's layer jobs until its prefill ends
        self.rooms: dict[str, dict] = {}       # rid -> its decode room, while this side has it
        self.released = WakeQueue()        # the transfer thread's endings; its fd wakes the worker's poll
        self.outcomes: dict[str, str] = {}      # rid -> how its transfer ended (for the caller)
        self.kv = KVSender(engine.runner.cache, engine.runner.cache.config, self._on_released, timeout_s)
        if engine.tp is not None:          # each rank sends its own shard (`tp_ranks`)
            from .tp_ranks import MirroredSender
            self.kv = MirroredSender(self.kv, engine.tp)
        self._rows: list = []
        self._opened: set[str] = set()         # requests whose transfer the thread has begun
        model = engine.model
        self._handles = [model.register_forward_pre_hook(self._before_forward)]
        self._handles += [layer.register_forward_hook(self._after_layer(i)) for i, layer in enumerate(model.layers)]

    def add(self, rid: str, prompt_ids: list[int], params, room: dict) -> None:
        """Queue a request; `params` are the client's (max_tokens is the decode side's business)."""
        self.engine.add_request({"prompt_token_ids": prompt_ids}, dataclasses.replace(params, max_tokens=1), rid)
        self.engine.requests[rid].hold_on_finish = True
        self.rooms[rid] = room

    def abort(self, rid: str) -> None:
        req = self.engine.requests.get(rid)
        self.engine.abort(rid)
        self._deferred.pop(rid, None)
        if rid in self._opened:
            self.kv.abort(rid)           # the transfer thread answers the room, then releases
        elif req is not None:            # never opened: nothing was sent, nothing to wait for
            self.engine.scheduler.release(rid)
            self.rooms.pop(rid, None)

    def step(self) -> list:
        """Return the held pages of finished transfers, then one engine step. Requests whose
        prefill finished are handed to the transfer thread's `done`."""
        self.drain_released()
        self._rows = []
        outs = self.engine.step() if self.engine.has_unfinished() else []
        if self.engine.speculator is not None:
            # the step also filled the MTP draft layer's rows of the positions it computed (the
            # decode side drafts from them): they travel as one more layer
            mtp = self.engine.model.config.num_hidden_layers
            for rid, t0, t1, final, pages in self._rows:
                job = (rid, mtp, t0, t1, final, pages)
                self.kv.layer_ready(*job) if self.overlap else self._deferred.setdefault(rid, []).append(job)
        for o in outs:
            if o.finished and o.request_id in self.rooms:
                req = self.engine.scheduler.held.get(o.request_id)
                for job in self._deferred.pop(o.request_id, []):
                    self.kv.layer_ready(*job)
                self.kv.finish(o.request_id, {"first_token": o.new_token_ids[0], "logprob": o.logprobs[-1],
                                              "top_logprobs": o.top_logprobs[-1], "cached_tokens": o.cached_tokens,
                                              "generator": generator_state(req.generator if req else None),
                                              "computed_at": time.time()})
                del self.rooms[o.request_id]
        return outs

    def drain_released(self) -> None:
        while True:
            try:
                rid, outcome = self.released.get_nowait()
            except queue.Empty:
                return
            if rid in self.engine.requests:    # still computing, but nobody will take its state now
                self.engine.abort(rid)
            if self.engine.tp is not None:     # the followers' transfers read the same pages on their ranks
                self.kv.release(rid)
            self.engine.scheduler.release(rid)
            self.rooms.pop(rid, None)
            self._opened.discard(rid)
            self._deferred.pop(rid, None)
            self.outcomes[rid] = outcome

    def has_work(self) -> bool:
        return self.engine.has_unfinished() or bool(self.engine.scheduler.held)

    def wakeups(self) -> WakeQueue:
        """What the worker's loop sleeps on beside its messages: the transfer thread's endings."""
        return self.released

    def runnable(self) -> bool:
        """Work a step can do now (held requests only wait for the transfer thread)."""
        return self.engine.has_unfinished() or not self.released.empty()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self.kv.close()
        self.released.close()

    # ---- the transfer thread's callback (not the engine thread) ----
    def _on_released(self, rid: str, outcome: str) -> None:
        self.released.put((rid, outcome))

    # ---- hooks on the model: which rows of this forward go where, then each layer as it ends ----
    def _before_forward(self, model, args) -> None:
        ctx = args[1]
        self._rows = []
        if not self.rooms:
            return
        by_slot = {r.slot: r for r in self.engine.scheduler.running if r.request_id in self.rooms}
        for b, slot in enumerate(ctx.state_slots_list):
            req: Request | None = by_slot.get(slot)
            if req is None:
                continue
            t0, n = ctx.start_pos[b], ctx.query_lens[b]
            pages = list(req.pages)
            room = self.rooms[req.request_id]
            if req.request_id not in self._opened:
                self._opened.add(req.request_id)
                self.kv.open(req.request_id, room, req.slot, pages)
                if t0 > room["skip_tokens"]:      # a prefix hit here: rows the decode side lacks, computed earlier
                    for lp in self.kv.pieces:
                        if lp.kind == "dsa":
                            self.kv.layer_ready(req.request_id, lp.layer, room["skip_tokens"], t0, False, pages)
            self._rows.append((req.request_id, t0, t0 + n, t0 + n == len(req.prompt_ids), pages))

    def _after_layer(self, i: int):
        def hook(module, args, out):
            for rid, t0, t1, final, pages in self._rows:
                if self.overlap:
                    self.kv.layer_ready(rid, i, t0, t1, final, pages)
                else:
                    self._deferred.setdefault(rid, []).append((rid, i, t0, t1, final, pages))
        return hook
