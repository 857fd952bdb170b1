"""The decode worker's reservations ("rooms") and the handshake that frees them safely.

A room is the pages and state slot the decode side set aside for one request's prefilled state.
The rule it keeps: **memory a prefill worker may still write is never given to anyone else.**

    reserve ──hello/go──> RECEIVING ──done (complete)──> COMPLETE (the engine decodes it)
       │                     │  └─done (incomplete) / failed / aborted / connection closed──> CLOSED (freed)
       │                     └─abort or timeout──> ABORTING ──aborted / failed / connection closed──> CLOSED
       └─abort, timeout, or a prefill that never said hello──> CLOSED (freed at once: no writer yet)

- A prefill worker writes nothing before it has said `hello` for the room and been answered
  `go` (under this table's lock), so a room freed before that can never be written: a late hello
  is answered `no`.
- Once `go` was answered, the room is freed only after its writer says it is finished (`done`,
  `failed`, `aborted`) or its connection closes (the writer process is gone: over tcp the writes
  are this process's own reads from that connection; over shm a dead process writes nothing).
  An abort or a timeout while receiving sends `abort` to the writer and waits for its answer.
- `done` is accepted only when every DSA layer's rows reached the prompt's end and every KDA layer's
  final state arrived; anything less frees the room with an error, so decode never runs on an
  incomplete state.

Events go to `on_event(kind, room, reason)`: `ready` (COMPLETE: the engine may schedule it) and
`free` (CLOSED: the engine returns the pages and slot). Both come from whichever thread decided.
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field


class RoomState(enum.Enum):
    RESERVED = "reserved"
    RECEIVING = "receiving"
    ABORTING = "aborting"
    COMPLETE = "complete"
    CLOSED = "closed"


@dataclass
class Room:
    rid: str
    pages: list[int]
    slot: int
    prompt_len: int
    skip_tokens: int            # tokens the decode side already holds (a prefix-cache hit): not sent
    deadline: float
    state: RoomState = RoomState.RESERVED
    writer: object = None       # the connection that was answered `go`
    covered: dict = field(default_factory=dict)   # DSA layer -> tokens received up to
    finals: set = field(default_factory=set)      # KDA layers whose final state arrived
    result: dict | None = None  # the `done` frame: first token and its logprobs
    image_rows: object = None   # a prompt with images: the tensor its image rows arrive into (`mm` frame)
    images_in: bool = False     # ... and whether they did
    reason: str | None = None   # why it was freed, if not consumed


class RoomTable:
    def __init__(self, dsa_layers: list[int], kda_layers: list[int], on_event, clock=time.monotonic):
        self.dsa_layers, self.kda_layers = list(dsa_layers), set(kda_layers)
        self.on_event, self.clock = on_event, clock
        self.rooms: dict[str, Room] = {}
        self.lock = threading.Lock()

    # ---- the decode engine's side ----
    def reserve(self, rid: str, pages: list[int], slot: int, prompt_len: int, skip_tokens: int, timeout_s: float,
                image_rows=None) -> Room:
        with self.lock:
            if rid in self.rooms:
                raise ValueError(f"request {rid!r} already has a room")
            room = Room(rid, list(pages), slot, prompt_len, skip_tokens, self.clock() + timeout_s, image_rows=image_rows)
            room.covered = dict.fromkeys(self.dsa_layers, skip_tokens)
            self.rooms[rid] = room
            return room

    def abort(self, rid: str, reason: str = "aborted") -> str:
        """The request is no longer wanted. Returns what happened: `freed` (no writer yet),
        `asked` (the writer is asked to stop; freed when it answers), `complete` (already
        handed to the engine: abort it there), or `unknown`."""
        with self.lock:
            room = self.rooms.get(rid)
            if room is None:
                return "unknown"
            if room.state is RoomState.RESERVED:
                self._close(room, reason)
                freed = True
            elif room.state is RoomState.RECEIVING:
                room.state, room.reason = RoomState.ABORTING, reason
                writer, freed = room.writer, False
            else:
                return room.state.value
        if freed:
            self.on_event("free", room, room.reason)
            return "freed"
        _ask_abort(writer, rid)
        return "asked"

    def expire(self) -> list[str]:
        """Rooms past their deadline: a reserved one is freed, a receiving one asked to stop."""
        now = self.clock()
        with self.lock:
            late = [r.rid for r in self.rooms.values()
                    if r.deadline <= now and r.state in (RoomState.RESERVED, RoomState.RECEIVING)]
        for rid in late:
            self.abort(rid, "timed out waiting for the prefill worker")
        return late

    def take(self, rid: str) -> Room:
        """A COMPLETE room handed to the engine: it leaves the table (its pages are the request's now)."""
        with self.lock:
            room = self.rooms.pop(rid)
            assert room.state is RoomState.COMPLETE, room.state
            return room

    # ---- the receiver threads' side (one per prefill connection) ----
    def hello(self, rid: str, conn) -> bool:
        with self.lock:
            room = self.rooms.get(rid)
            if room is None or room.state is not RoomState.RESERVED:
                return False
            room.state, room.writer = RoomState.RECEIVING, conn
            return True

    def destination(self, rid: str, conn) -> Room | None:
        """The room a kv frame from `conn` may be written into, or None (drop the frame)."""
        room = self.rooms.get(rid)
        if room is None or room.writer is not conn or room.state not in (RoomState.RECEIVING, RoomState.ABORTING):
            return None
        return room

    def received(self, rid: str, conn, layer: int, t0: int, t1: int, final: bool) -> None:
        """Book a kv frame written into the room; a frame out of order marks the room broken."""
        with self.lock:
            room = self.destination(rid, conn)
            if room is None:
                return
            if layer in room.covered:
                if t0 != room.covered[layer] or t1 > room.prompt_len:
                    room.reason = f"layer {layer}: rows {t0}..{t1} do not follow {room.covered[layer]}"
                room.covered[layer] = max(room.covered[layer], t1)
            if final and layer in self.kda_layers:
                room.finals.add(layer)

    def received_images(self, rid: str, conn) -> None:
        """Book the image rows (read into `room.image_rows`): a preempted request recomputes from them."""
        with self.lock:
            room = self.destination(rid, conn)
            if room is not None and room.image_rows is not None:
                room.images_in = True

    def finished(self, rid: str, conn, kind: str, frame: dict) -> None:
        """The writer's last word for the room: `done` (with the first token), `failed`, or
        `aborted`. After it the writer writes nothing more for this room."""
        event = None
        with self.lock:
            room = self.destination(rid, conn)
            if room is None:
                return
            if kind == "done" and room.state is RoomState.RECEIVING:
                missing = self._missing(room)
                if missing is None:
                    room.state, room.result = RoomState.COMPLETE, frame
                    event = ("ready", room, None)
                else:
                    self._close(room, f"the prefill worker reported done with an incomplete state ({missing})")
                    event = ("free", room, room.reason)
            else:
                self._close(room, frame.get("message") or kind)
                event = ("free", room, room.reason)
        self.on_event(*event)

    def connection_closed(self, conn, why: str | None = None) -> None:
        """The writer is gone: nothing more can arrive from it. Its unfinished rooms are freed (`why`:
        the frame error that broke the connection, where one did)."""
        reason = "the prefill worker's connection closed before it finished" + (f" ({why})" if why else "")
        with self.lock:
            gone = [r for r in self.rooms.values()
                    if r.writer is conn and r.state in (RoomState.RECEIVING, RoomState.ABORTING)]
            for r in gone:
                self._close(r, reason)
        for r in gone:
            self.on_event("free", r, r.reason)

    # ---- helpers ----
    def _missing(self, room: Room) -> str | None:
        if room.reason:
            return room.reason
        short = [f"layer {k} rows up to {v}" for k, v in room.covered.items() if v != room.prompt_len]
        states = sorted(self.kda_layers - room.finals)
        images = ["no image rows"] if room.image_rows is not None and not room.images_in else []
        if short or states or images:
            return "; ".join(short + ([f"no final state for layers {states}"] if states else []) + images)
        return None

    def _close(self, room: Room, reason: str) -> None:
        """Under the lock; the caller sends the `free` event once it is released. The room leaves
        the table; its pages and slot go back to the engine."""
        room.state, room.reason = RoomState.CLOSED, room.reason or reason
        self.rooms.pop(room.rid, None)

    def __len__(self) -> int:
        return len(self.rooms)


def _ask_abort(writer, rid: str) -> None:
    """Tell the writer to stop writing `rid` (over its own connection); it answers `aborted`."""
    if writer is not None:
        try:
            writer.send_control({"type": "abort", "rid": rid})
        except OSError:
            pass      # the connection is going away: connection_closed frees the room
