"""The prefill worker's transfer thread: a request's state, layer by layer, into its decode room.

The compute thread only queues work (`open`, `layer_ready`, `finish`, `fail`, `abort`): a queued
layer is gathered from this worker's cache and sent on this thread while the next layers compute.
Per request, on its connection to the decode worker:

    hello ─(wait for go)─> kv frames in the order they were queued ─> done | failed | aborted

Nothing is written before `go`. After `go` the last frame is always one of done / failed /
aborted, and nothing for the request follows it. A `no` (the room is gone) or an abort before
`go` sends nothing more; a `go` that arrives for a request this side gave up is answered
`aborted`. When a request's last frame is out (or it was never allowed to write), `on_released(rid,
outcome)` tells the engine it may free the request's pages and slot here: until then they are read.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

from ..measure.spans import span
from .shared_cache import attach
from .state_pieces import gather, layer_pieces, page_segments
from .transfer import Sender, TransferError


@dataclass
class Outgoing:
    rid: str
    room: dict                     # address, backend, pages, slot, skip_tokens, prompt_len, (shm) cache spec
    sender: Sender
    slot: int                      # this worker's
    pages: list[int]               # this worker's
    state: str = "hello"           # hello -> go -> ended
    opened_at: float = field(default_factory=time.monotonic)
    pending: list = field(default_factory=list)   # jobs queued before go
    gave_up: bool = False


TICK_S = 0.5       # how often the transfer thread looks for rooms that never answered


def _next_job(jobs: queue.Queue):
    """The transfer thread's wait for work: a blocking get, which releases the GIL while it
    waits; a tick now and then lets it give up on rooms that never answered `hello`."""
    try:
        return jobs.get(timeout=TICK_S)
    except queue.Empty:
        return ("tick", None, None)


class KVSender:
    def __init__(self, cache, config, on_released, timeout_s: float = 30.0):
        self.cache, self.pieces = cache, layer_pieces(config)
        self.on_released, self.timeout_s = on_released, timeout_s
        self.out: dict[str, Outgoing] = {}
        self.senders: dict[tuple, Sender] = {}          # (address, backend) -> connection
        self.remote: dict[str, object] = {}            # shm cache spec path -> attached cache
        self.jobs: queue.Queue = queue.Queue()
        self.bytes_sent = 0
        self.thread = threading.Thread(target=self._loop, name="ouro-kv-sender", daemon=True)
        self.thread.start()

    # ---- the compute thread's side: queue only ----
    def open(self, rid: str, room: dict, slot: int, pages: list[int]) -> None:
        self.jobs.put(("open", rid, (room, slot, list(pages))))

    def layer_ready(self, rid: str, layer: int, t0: int, t1: int, final: bool, pages: list[int] | None = None) -> None:
        """Layer `layer`'s rows of tokens [t0, t1) are computed (`final`: the prompt's last); `pages`:
        the request's pages now, when they grew since `open` (chunked prefill)."""
        self.jobs.put(("kv", rid, (layer, t0, t1, final, pages)))

    def image_rows(self, rid: str, rows) -> None:
        """The prompt's image rows: the decode side recomputes from them if it ever preempts the request."""
        self.jobs.put(("mm", rid, rows))

    def finish(self, rid: str, result: dict) -> None:
        self.jobs.put(("done", rid, result))

    def fail(self, rid: str, message: str) -> None:
        self.jobs.put(("failed", rid, {"message": message}))

    def abort(self, rid: str) -> None:
        self.jobs.put(("abort", rid, None))

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(5)
        for s in self.senders.values():
            s.close()

    # ---- the transfer thread ----
    def _loop(self) -> None:
        while (job := _next_job(self.jobs)) is not None:
            kind, rid, arg = job
            try:
                if kind == "tick":
                    self._expire()
                elif kind == "control":
                    self._control(*arg)
                else:
                    self._handle(kind, rid, arg)
            except (OSError, TransferError) as e:       # the decode worker is gone: its rooms close there
                o = self.out.get(rid)
                if o is not None:
                    self._end(o, f"transfer failed: {type(e).__name__}: {e}")

    def _handle(self, kind, rid, arg) -> None:
        if kind == "open":
            room, slot, pages = arg
            sender = self._sender(room)
            self.out[rid] = o = Outgoing(rid, room, sender, slot, pages)
            hello = {"type": "hello", "rid": rid}
            if room.get("announce"):      # a TP follower's: its decode rank opens the room from this
                hello["room"] = {k: room[k] for k in ("pages", "slot", "prompt_len", "skip_tokens")}
            sender.notify(hello)
            return
        o = self.out.get(rid)
        if o is None:
            return
        if kind == "abort":
            o.gave_up = True
            if o.state == "go":
                o.sender.notify({"type": "aborted", "rid": rid})
                self._end(o, "aborted")
            return                       # before go: the answer to hello ends it
        if o.gave_up:
            return
        if o.state == "hello":
            o.pending.append((kind, arg))
            return
        self._send(o, kind, arg)

    def _expire(self) -> None:
        """A request whose room never answered `hello` within the timeout is given up here (nothing
        was written: a `go` arriving later is answered `aborted`, so the room is freed there too)."""
        now = time.monotonic()
        for o in [o for o in self.out.values() if o.state == "hello" and now - o.opened_at > self.timeout_s]:
            self._end(o, f"no answer from the decode worker within {self.timeout_s:.0f} s")

    def _control(self, header: dict, sender: Sender) -> None:
        """A frame from a decode worker (`go`, `no`, `abort`), or the end of its connection."""
        kind, rid = header["type"], header.get("rid")
        if kind == "closed":             # the decode worker hung up: every request on it ends here
            self.senders = {k: v for k, v in self.senders.items() if v is not sender}
            for o in [o for o in self.out.values() if o.sender is sender]:
                self._end(o, "the decode worker closed the connection")
            return
        o = self.out.get(rid)
        if kind == "go":
            if o is None or o.gave_up:
                sender.notify({"type": "aborted", "rid": rid})
                if o is not None:
                    self._end(o, "aborted")
                return
            o.state = "go"
            for k, a in o.pending:
                self._send(o, k, a)
            o.pending = []
        elif o is not None and kind == "no":
            self._end(o, "refused: " + header.get("reason", "the decode worker has no room for it"))
        elif o is not None and kind == "abort":
            o.gave_up = True
            if o.state == "go":
                o.sender.notify({"type": "aborted", "rid": rid})
            self._end(o, "aborted by the decode worker")

    def _send(self, o: Outgoing, kind, arg) -> None:
        if o.state != "go":
            return
        if kind == "kv":
            layer, t0, t1, final, pages = arg
            if pages is not None:
                o.pages = pages
            lo = max(t0, o.room["skip_tokens"])
            lp = self.pieces[layer]
            if lo >= t1 and not (final and lp.kind == "kda"):
                return
            lo = min(lo, t1)
            with span("kv gather", cat="transfer"):
                blocks = gather(self.cache, lp, o.pages, o.slot, lo, t1, final)
            if not blocks:
                return
            header = {"type": "kv", "rid": o.rid, "layer": layer, "t0": lo, "t1": t1, "final": final}
            views = None
            if o.room["backend"] != "tcp":    # the sender writes: name the decode worker's own segments
                views = page_segments(self._remote(o.room), lp, o.room["pages"], o.room["slot"], lo, t1, final)
            o.sender.put(header, blocks, views)
            self.bytes_sent += sum(b.numel() * b.element_size() for b in blocks)
        elif kind == "mm":
            self.bytes_sent += o.sender.send_inline({"type": "mm", "rid": o.rid}, [arg])
        else:                             # done / failed: the request's last frame
            o.sender.notify(dict(arg, type=kind, rid=o.rid))
            self._end(o, kind)

    def _end(self, o: Outgoing, outcome: str) -> None:
        if self.out.pop(o.rid, None) is not None:
            self.on_released(o.rid, outcome)

    def _sender(self, room: dict) -> Sender:
        key = (room["address"], room["backend"])
        s = self.senders.get(key)
        if s is None:
            writer = self._remote(room, writer=True) if room["backend"] == "mooncake" else None
            s = Sender(room["address"], room["backend"], self.timeout_s, writer)
            s.listen(lambda h, s=s: self.jobs.put(("control", None, (h, s))))
            self.senders[key] = s
        return s

    def _remote(self, room: dict, writer: bool = False):
        """The decode worker's cache as this side sees it: mapped files (shm) or a Mooncake
        writer's shadow (mooncake); `writer`: the writer itself."""
        spec = room["cache"]
        if room["backend"] == "shm":
            key = spec["tensors"]["latent"]["path"]
            if key not in self.remote:
                self.remote[key] = attach(spec)
            return self.remote[key]
        from .mooncake_backend import MooncakeWriter
        if spec["target"] not in self.remote:
            self.remote[spec["target"]] = MooncakeWriter(spec)
        w = self.remote[spec["target"]]
        return w if writer else w.shadow
