"""`ouro serve --role prefill`: an `LLMEngine` that prefills requests and sends their state away.

A request arrives with its decode room (`KVReceiver.room_info`). Under `--cp N` a long prompt is
prefilled across CP ranks; this worker is the last of them and keeps every layer's rows (with
`--cp-layer-split` too), so each CP forward's rows go from here as they would without CP. It runs as a one-token request
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

from ..engine.multimodal import ImageInputs, image_spans
from ..engine.request import Request
from .encoder_cache import EmbedsReceiver, EncoderCache, ImageWaits
from .kv_sender import KVSender
from .state_pieces import check_layout
from .wake_queue import WakeQueue


def generator_state(gen: torch.Generator | None) -> str | None:
    return None if gen is None else base64.b64encode(gen.get_state().numpy().tobytes()).decode()


def set_generator_state(gen: torch.Generator | None, state: str | None) -> None:
    if gen is not None and state is not None:
        gen.set_state(torch.frombuffer(bytearray(base64.b64decode(state)), dtype=torch.uint8))


class PrefillEngine:
    def __init__(self, engine, timeout_s: float = 30.0, overlap: bool = True, images: bool = False,
                 encoder_cache_bytes: int = 256 << 20, host: str = "127.0.0.1"):
        """overlap=False: a request's layers are queued only once its prefill is done (the A/B
        that shows what overlapping the transfer with compute buys). images: the checkpoint takes
        images: listen for encode workers' rows (`encoder_cache`)."""
        self.engine, self.overlap = engine, overlap
        self._deferred: dict[str, list] = {}    # overlap off: each request's layer jobs until its prefill ends
        self.rooms: dict[str, dict] = {}       # rid -> its decode room, while this side has it
        self.released = WakeQueue()        # the transfer thread's endings; its fd wakes the worker's poll
        self.outcomes: dict[str, str] = {}      # rid -> how its transfer ended (for the caller)
        self.kv = KVSender(engine.cache, engine.cache.config, self._on_released, timeout_s)
        if engine.tp is not None:          # each rank sends its own shard (`tp_ranks`)
            from .tp_ranks import MirroredSender
            self.kv = MirroredSender(self.kv, engine.tp)
        self._rows: list = []
        self._opened: set[str] = set()         # requests whose transfer the thread has begun
        self.asks: list[tuple[str, list[str]]] = []          # (rid, image hashes) to ask the router for
        self.failures: list[tuple[str, str, int]] = []       # (rid, why, status) for the caller to report
        self.waits = ImageWaits(EncoderCache(encoder_cache_bytes), min(timeout_s, 10.0))
        self.embeds = None
        if images:
            self.embeds = EmbedsReceiver(engine.model.config.hidden_size, lambda h, rows: self.released.put(("rows", h, rows)),
                                         f"{host}:0")
        model = engine.model
        self._handles = [model.register_forward_pre_hook(self._before_forward)]
        self._handles += [layer.register_forward_hook(self._after_layer(i)) for i, layer in enumerate(model.layers)]

    def add(self, rid: str, prompt_ids: list[int], params, room: dict, images: dict | None = None) -> None:
        """Queue a request; `params` are the client's (max_tokens is the decode side's business).
        `images` (a prompt with images, expanded): {"hashes": [...], "coming": [hashes an encode
        worker is sending now]} (rows from the encoder cache), or {"hashes", "data": [encoded
        images]} (no encode worker: encoded here)."""
        params = dataclasses.replace(params, max_tokens=1)
        check_layout(self.engine.cache, room)        # before anything is computed for a room it cannot fill
        if rid in self.waits.waiting:
            raise ValueError(f"duplicate request id {rid!r}")
        prompt = {"prompt_token_ids": prompt_ids}
        if not images:
            return self._admit(rid, prompt, params, room)
        hashes = list(images.get("hashes") or [])
        if images.get("data") is not None:
            from ..engine.multimodal import as_images
            from ..serve.messages import images_from_wire
            ids, _ = self.engine.check_request(prompt, params, rid)
            mm = self.engine.image_encoder().encode(ids, as_images(images_from_wire(images["data"])), hashes or None)
            return self._admit(rid, prompt, params, room, mm)
        if self.embeds is None:
            raise ValueError("this checkpoint takes no images")
        self.drain_released()        # rows that came in since the last step are filed before the lookup
        ids, _ = self.engine.check_request(prompt, params, rid)      # a bad request is refused before it waits
        n_images = len(image_spans(ids, self.engine.model.config))
        if n_images != len(hashes):
            raise ValueError(f"the prompt has {n_images} images, the request names {len(hashes)}")
        wait, ask = self.waits.add(rid, (prompt, params, room), hashes, images.get("coming", ()))
        if ask:
            self.asks.append((rid, ask))
        if not wait.missing():
            self._admit_waited(wait)

    def _admit(self, rid, prompt, params, room, mm=None) -> None:
        self.engine.add_request(prompt, params, rid, mm=mm)
        self.engine.requests[rid].hold_on_finish = True
        self.rooms[rid] = room

    def _admit_waited(self, wait) -> None:
        prompt, params, room = wait.request
        ids = prompt["prompt_token_ids"]
        try:
            mm = ImageInputs.from_rows(ids, self.engine.model.config, [wait.got[h] for h in wait.hashes], wait.hashes)
            self._admit(wait.rid, prompt, params, room, mm)
        except ValueError as e:             # rows that do not fit the prompt: this request fails, nothing else
            self.failures.append((wait.rid, f"the encoded images do not fit the prompt: {e}", 400))

    def _images(self) -> None:
        """Requests waiting for image rows: admit the complete, ask again for the overdue, fail the lost."""
        again, lost = self.waits.overdue()
        self.asks += [(w.rid, w.missing()) for w in again]
        self.failures += [(w.rid, f"the rows of {len(w.missing())} image(s) never reached this prefill worker "
                                  f"after {w.asks} asks (is an encode worker up?)", 503) for w in lost]

    def abort(self, rid: str) -> None:
        if self.waits.drop(rid):         # still waiting for its images: nothing computed, nothing sent
            return
        req = self.engine.requests.get(rid)
        self.engine.abort(rid)
        self._deferred.pop(rid, None)
        if rid in self._opened:
            self.kv.abort(rid)           # the transfer thread answers the room, then releases
        elif req is not None:            # never opened: nothing was sent, nothing to wait for
            self.engine.release_held(rid)
            self.rooms.pop(rid, None)

    def step(self) -> list:
        """Return the held pages of finished transfers, then one engine step. Requests whose
        prefill finished are handed to the transfer thread's `done`."""
        self.drain_released()
        self._images()
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
                req = self.engine.held_request(o.request_id)
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
                item = self.released.get_nowait()
            except queue.Empty:
                return
            if item[0] == "rows" and len(item) == 3:       # an image's rows from an encode worker
                for wait in self.waits.arrived(item[1], item[2]):
                    self._admit_waited(wait)
                continue
            rid, outcome = item
            if rid in self.engine.requests:    # still computing, but nobody will take its state now
                self.engine.abort(rid)
            if self.engine.tp is not None:     # the followers' transfers read the same pages on their ranks
                self.kv.release(rid)
            self.engine.release_held(rid)
            self.rooms.pop(rid, None)
            self._opened.discard(rid)
            self._deferred.pop(rid, None)
            self.outcomes[rid] = outcome

    def has_work(self) -> bool:
        return self.engine.has_unfinished() or bool(self.engine.num_held()) or bool(self.waits)

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
        if self.embeds is not None:
            self.embeds.close()
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
        by_slot = {r.slot: r for r in self.engine.running() if r.request_id in self.rooms}
        for b, slot in enumerate(ctx.state_slots_list):
            req: Request | None = by_slot.get(slot)
            if req is None:
                continue
            t0, n = _new_rows(ctx, b)
            pages = list(req.pages)
            room = self.rooms[req.request_id]
            if req.request_id not in self._opened:
                self._opened.add(req.request_id)
                self.kv.open(req.request_id, room, req.slot, pages)
                if req.mm is not None:            # the decode side recomputes from them after a preemption
                    self.kv.image_rows(req.request_id, req.mm.embeds)
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


def _new_rows(ctx, b: int) -> tuple[int, int]:
    """(first position, count) of sequence b's rows this forward leaves in this rank's cache: its
    own new tokens, or under a context-parallel prefill (`--cp`) the whole CP forward's, which
    the all-gathers wrote here (this rank is the engine, the last CP rank, and keeps every layer)."""
    peers = getattr(ctx, "peers", None)
    if not peers:
        return ctx.start_pos[b], ctx.query_lens[b]
    return peers[0].start_pos[b], peers[-1].start_pos[b] + peers[-1].query_lens[b] - peers[0].start_pos[b]
