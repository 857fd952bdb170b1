"""The decode worker's end of the transfer: a `Receiver` whose frames drive the `RoomTable`.

- `hello` -> `go` when the room is still reserved (it is now that connection's to write), else `no`;
- `mm` -> the prompt's image rows (any backend: inline bytes) into the room's `image_rows`;
- `kv` -> over tcp the blocks are read straight into the room's pages and slot (`page_segments`),
  over shm they are already there; either way the rows are booked;
- `done` / `failed` / `aborted` -> the room completes or is freed (`RoomTable.finished`);
- a connection's end frees its unfinished rooms.
"""

from __future__ import annotations

import time

from .rooms import RoomTable
from .state_pieces import cache_layout, layer_pieces, page_segments
from .transfer import Receiver


class KVReceiver:
    def __init__(self, cache, config, on_event, address: str = "127.0.0.1:0", backend: str = "tcp",
                 shared_spec: dict | None = None):
        self.cache, self.pieces = cache, layer_pieces(config)
        self.rooms = RoomTable(config.dsa_layers, config.kda_layers, on_event)
        self.backend, self.shared_spec = backend, shared_spec
        self.layout = cache_layout(cache)
        self._broke: dict = {}            # peer -> why its connection broke (said in its rooms' reason)
        self.receiver = Receiver(self._resolve, self._frame, self._error, self._closed, address)
        self.address = self.receiver.address
        self.errors: list[str] = []

    def room_info(self, room) -> dict:
        """What the prefill worker needs to write into `room` (travels with the request)."""
        info = {"address": self.address, "backend": self.backend, "pages": room.pages, "slot": room.slot,
                "skip_tokens": room.skip_tokens, "prompt_len": room.prompt_len, "layout": self.layout}
        if self.backend != "tcp":
            info["cache"] = self.shared_spec
        return info

    def _resolve(self, header, peer):
        kind = header.get("type")
        room = self.rooms.destination(header.get("rid"), peer) if kind in ("kv", "mm") else None
        if room is None:
            return None
        if kind == "mm":                  # the prompt's image rows, straight into the request's tensor
            return None if room.image_rows is None else [[room.image_rows]]
        return page_segments(self.cache, self.pieces[header["layer"]], room.pages, room.slot,
                             header["t0"], header["t1"], header["final"])

    def _frame(self, header, peer) -> None:
        kind, rid = header.get("type"), header.get("rid")
        if kind == "hello":
            ok = self.rooms.hello(rid, peer)
            peer.send_control({"type": "go" if ok else "no", "rid": rid})
        elif kind == "kv":
            self.rooms.received(rid, peer, header["layer"], header["t0"], header["t1"], header["final"])
        elif kind == "mm":
            self.rooms.received_images(rid, peer)
        elif kind in ("done", "failed", "aborted"):
            self.rooms.finished(rid, peer, kind, dict(header, received_at=time.time()))

    def _error(self, peer, message: str) -> None:
        self.errors.append(f"{peer}: {message}")
        self._broke[peer] = message

    def _closed(self, peer) -> None:
        self.rooms.connection_closed(peer, self._broke.pop(peer, None))

    def close(self) -> None:
        self.receiver.close()
