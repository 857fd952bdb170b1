"""`ouro serve --role decode`: an `LLMEngine` whose requests arrive prefilled by another worker.

`reserve` checks a request, sets aside a state slot and the pages its prompt needs, and opens a
room (`RoomTable`) that a prefill worker fills over the transfer (`KVReceiver`). With prefix
caching on, the full pages of a prompt prefix this worker already holds are the room's first pages
and their rows are not sent again (`skip_tokens`); the KDA state always comes from the prefill. The room's
events come back from the receiver threads through a queue and are handled on the engine thread,
at the start of each `step`:
- `ready`: the room's state is complete; the request joins the running batch with its prompt
  computed and the first token (sampled by the prefill worker) as its first output;
- `free`: the room closed without a complete state (aborted, timed out, the prefill worker failed
  or vanished, an incomplete transfer): its pages and slot go back, and the request fails with the
  reason unless the client had aborted it.
Pages and slot of a room are never given to anyone else while a prefill worker may write them:
aborts go through the room table (`RoomTable.abort`), not straight to the scheduler.
"""

from __future__ import annotations

import queue
import time

import torch

from ..engine.multimodal import ImageInputs, image_positions, image_spans
from ..engine.page_pool import NoRoom   # the decode worker cannot take the request now: the router answers 503
from ..engine.request import Request
from ..measure.spans import span
from . import shared_cache
from .kv_receiver import KVReceiver
from .prefill_engine import set_generator_state
from .wake_queue import WakeQueue


def awaited_images(ids: list[int], config, hashes: list[str]) -> ImageInputs:
    """A prompt's image inputs before their rows arrive: keyed by `hashes`, the rows NaN until the
    prefill worker's `mm` frame fills them (a row never written shows)."""
    counts = [n for _, n in image_spans(ids, config)]
    if len(counts) != len(hashes):
        raise ValueError(f"the prompt has {len(counts)} images, the request names {len(hashes)}")
    rows = torch.full((sum(counts), config.hidden_size), float("nan"))
    return ImageInputs(image_positions(ids, config), rows, list(hashes), counts)


class DecodeEngine:
    def __init__(self, engine, backend: str = "tcp", address: str = "127.0.0.1:0", timeout_s: float = 30.0):
        self.engine, self.timeout_s = engine, timeout_s
        self.spec = None
        if backend == "shm":
            self.spec = shared_cache.share(engine.cache, f"{address.replace(':', '-')}-{time.monotonic_ns()}")
        elif backend == "mooncake":
            from .mooncake_backend import MooncakeTarget
            self.target = MooncakeTarget(engine.cache, address.rsplit(":", 1)[0])   # kept: its engine listens
            self.spec = self.target.spec
        self.events = WakeQueue()          # the receiver threads' events; its fd wakes the worker's poll
        self.kv = KVReceiver(engine.cache, engine.cache.config, lambda *e: self.events.put(e), address,
                             backend, self.spec)
        self.tp, self.addresses = engine.tp, None
        if self.tp is not None:            # every rank receives its own shard (`tp_ranks`)
            if backend != "tcp":
                raise ValueError(f"a decode worker with --tp takes the tcp transfer backend, not {backend!r}")
            from . import tp_ranks
            self.addresses = tp_ranks.receiver_addresses(self.tp, self.kv.address)
        self.reserved: dict[str, Request] = {}
        self.client_aborted: set[str] = set()
        self.failures: list[tuple[str, str]] = []     # (rid, why) not yet reported by the caller
        self.transfers = {"completed": 0, "failed": 0}
        self.latencies: list[float] = []              # seconds from the last layer computed to the room complete

    @property
    def address(self) -> str:
        return self.kv.address

    def reserve(self, rid: str, prompt_ids: list[int], params, image_hashes: list[str] | None = None) -> dict:
        """A room for the request: its slot and prompt pages. Raises ValueError (a bad request)
        or NoRoom (no slot or pages free now). `image_hashes`: the keys of a prompt's images
        (expanded in `prompt_ids`): its prefix-cache key, and a tensor the image rows arrive into."""
        e = self.engine
        ids, params = e.check_request({"prompt_token_ids": prompt_ids}, params, rid)
        if rid in self.reserved:
            raise ValueError(f"duplicate request id {rid!r}")
        mm = awaited_images(ids, e.model.config, image_hashes) if image_hashes else None
        try:
            req = e.reserve_prefilled(rid, ids, params, mm)
        except NoRoom as err:
            raise NoRoom(f"{err} on the decode worker") from None
        held = req.prefix_match
        self.reserved[rid] = req
        room = self.kv.rooms.reserve(rid, req.pages, req.slot, len(ids), held.usable_tokens if held else 0, self.timeout_s,
                                     image_rows=mm.embeds if mm is not None else None)
        info = self.kv.room_info(room)
        if self.addresses:
            info["addresses"] = self.addresses
        return info

    def abort(self, rid: str) -> None:
        if rid in self.reserved:
            self.client_aborted.add(rid)
            if self.tp is not None:
                from .tp_ranks import abort_room
                abort_room(self.tp, rid)
            if self.kv.rooms.abort(rid) != "complete":
                return                   # freed now or when its writer answers: a `free` event
        self.engine.abort(rid)

    def has_work(self) -> bool:
        return self.engine.has_unfinished() or bool(self.reserved) or not self.events.empty()

    def wakeups(self) -> WakeQueue:
        """What the worker's loop sleeps on beside its messages: the rooms' events."""
        return self.events

    def runnable(self) -> bool:
        """Work a step can do now (reserved rooms only wait for their prefill worker)."""
        return self.engine.has_unfinished() or not self.events.empty()

    @span("decode step", cat="step")
    def step(self) -> list:
        """Handle the rooms' events, then one engine step. Returns the outputs (a request's first
        output carries the prefill worker's token); failed rooms are in `failures`."""
        self.kv.rooms.expire()
        outs = self._events()
        if self.engine.has_unfinished():
            outs += self.engine.step()
        return outs

    def _events(self) -> list:
        outs = []
        while True:
            try:
                kind, room, reason = self.events.get_nowait()
            except queue.Empty:
                return outs
            if room.rid not in self.reserved:
                continue
            # asked while the request is still reserved: a lost rank (TPBroken) fails it with the rest
            missing = self._followers_missing(room.rid) if kind == "ready" else 0
            req = self.reserved.pop(room.rid)
            if kind == "ready":
                result = self.kv.rooms.take(room.rid).result
                if missing:
                    self._fail(req, f"the prefilled state did not arrive on {missing} of the tensor-parallel ranks")
                    continue
                self.transfers["completed"] += 1
                if "computed_at" in result:
                    self.latencies.append(max(0.0, result["received_at"] - result["computed_at"]))
                outs.append(self._activate(req, result))
            else:
                if self.tp is not None:
                    from .tp_ranks import abort_room
                    abort_room(self.tp, room.rid)
                self._fail(req, f"the prefilled state did not arrive: {reason}")

    def _followers_missing(self, rid: str) -> int:
        if self.tp is None:
            return 0
        from .tp_ranks import followers_missing
        return followers_missing(self.tp, rid, self.timeout_s)

    def _fail(self, req: Request, why: str) -> None:
        self.transfers["failed"] += 1
        self.engine.release_reserved(req)
        if req.request_id not in self.client_aborted:
            self.failures.append((req.request_id, why))
        self.client_aborted.discard(req.request_id)

    def _activate(self, req: Request, result: dict):
        """The request joins the running batch: prompt computed, first token already sampled."""
        set_generator_state(req.generator, result.get("generator"))
        out = self.engine.activate_prefilled(req, result["first_token"], result.get("logprob"),
                                             result.get("top_logprobs"), result.get("cached_tokens", 0))
        if req.request_id in self.client_aborted:
            self.client_aborted.discard(req.request_id)
            self.engine.abort(req.request_id)
        return out

    def close(self) -> None:
        self.kv.close()
        self.events.close()
        if self.spec and self.kv.backend == "shm":
            shared_cache.unlink(self.spec)
