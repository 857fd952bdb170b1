"""The language side's encoder cache: image rows that encode workers sent, keyed by image hash.

An encode worker sends each image's rows as one transfer frame ({"type": "embeds", "hash",
"shape"} + the float32 rows) to the prefill worker's `EmbedsReceiver`, whose connection thread
reads them straight into a fresh tensor and hands it to the engine thread; there it is filed in
the `EncoderCache` (least recently used out first, bounded in bytes) and given to every request
waiting for it.

A request with images waits (`ImageWaits`) until it holds each image's rows. It keeps what it
found, so an eviction while it waits loses nothing; rows that arrive before their request are held
for it apart from the cache (claimed once, dropped after `wait_s`), so a small cache loses
nothing in transit either. An image neither cached nor on its way is a
miss: the worker asks the router for it again (`need_images`), and asks again after `wait_s`
without it; after `max_asks` asks the request fails (503). A miss never takes the worker down.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .transfer import Receiver, TransferError


class EncoderCache:
    def __init__(self, capacity_bytes: int):
        self.capacity = int(capacity_bytes)
        self.rows: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0

    def get(self, key: str) -> torch.Tensor | None:
        t = self.rows.get(key)
        if t is None:
            self.misses += 1
            return None
        self.hits += 1
        self.rows.move_to_end(key)
        return t

    def put(self, key: str, rows: torch.Tensor) -> None:
        size = rows.numel() * rows.element_size()
        if key in self.rows or size > self.capacity:
            return
        while self.rows and self.bytes + size > self.capacity:
            _, old = self.rows.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()
        self.rows[key] = rows
        self.bytes += size

    def stats(self) -> dict:
        return {"encoder_cache_hits": self.hits, "encoder_cache_misses": self.misses,
                "encoder_cache_bytes": self.bytes, "encoder_cache_entries": len(self.rows)}


class EmbedsReceiver:
    """The prefill worker's listener for encode workers: `on_rows(hash, rows)` per image, from a
    connection thread. A frame of the wrong shape or dtype breaks only its connection."""

    def __init__(self, hidden_size: int, on_rows, address: str = "127.0.0.1:0", max_rows: int = 1 << 16):
        self.hidden, self.on_rows, self.max_rows = hidden_size, on_rows, max_rows
        self.errors: list[str] = []
        self.receiver = Receiver(self._resolve, self._frame, lambda peer, msg: self.errors.append(f"{peer}: {msg}"),
                                 address=address)
        self.address = self.receiver.address

    def _resolve(self, header, peer):
        if header.get("type") != "embeds":
            return None
        shape = header.get("shape")
        if (not isinstance(shape, list) or len(shape) != 2 or shape[1] != self.hidden
                or not 0 < shape[0] <= self.max_rows or header.get("dtype") != "float32"
                or not isinstance(header.get("hash"), str)):
            raise TransferError(f"image rows must be float32 [1..{self.max_rows}, {self.hidden}] with a hash, "
                                f"got {header.get('dtype')} {shape}")
        header["_rows"] = rows = torch.empty(shape)
        return [[rows]]

    def _frame(self, header, peer) -> None:
        if "_rows" in header:
            self.on_rows(header["hash"], header["_rows"])

    @property
    def bytes_received(self) -> int:
        return self.receiver.bytes_received

    def close(self) -> None:
        self.receiver.close()


@dataclass
class Waiting:
    rid: str
    request: tuple                 # what to add once every image is here (the caller's)
    hashes: list[str]
    got: dict = field(default_factory=dict)
    asked_at: float = 0.0
    asks: int = 0

    def missing(self) -> list[str]:
        return [h for h in dict.fromkeys(self.hashes) if h not in self.got]


class ImageWaits:
    def __init__(self, cache: EncoderCache, wait_s: float = 10.0, max_asks: int = 3, clock=time.monotonic):
        self.cache, self.wait_s, self.max_asks, self.clock = cache, wait_s, max_asks, clock
        self.waiting: dict[str, Waiting] = {}
        # rows that came before their request: held for it whatever the cache keeps (a small or
        # full cache must not lose rows in transit), claimed once, dropped after `wait_s`
        self.fresh: dict[str, list[tuple[torch.Tensor, float]]] = {}

    def _lookup(self, key: str) -> torch.Tensor | None:
        held = self.fresh.get(key)
        if held:
            rows, _ = held.pop(0)
            if not held:
                del self.fresh[key]
            self.cache.hits += 1
            return rows
        return self.cache.get(key)

    def add(self, rid: str, request: tuple, hashes: list[str], coming=()) -> tuple[Waiting, list[str]]:
        """Look the request's images up; returns (its wait, the misses to ask for now: neither
        cached nor in `coming`, the hashes the router says are being encoded for it)."""
        w = Waiting(rid, request, list(hashes), asked_at=self.clock())
        for h in w.missing():
            rows = self._lookup(h)
            if rows is not None:
                w.got[h] = rows
        ask = [h for h in w.missing() if h not in set(coming)]
        if ask:
            w.asks = 1
        if w.missing():
            self.waiting[rid] = w
        return w, ask

    def arrived(self, key: str, rows: torch.Tensor) -> list[Waiting]:
        """File the rows; returns the waits they completed (they leave the table)."""
        self.cache.put(key, rows)
        done, claimed = [], False
        for w in list(self.waiting.values()):
            if key in w.hashes and key not in w.got:
                w.got[key], claimed = rows, True
                if not w.missing():
                    done.append(self.waiting.pop(w.rid))
        if not claimed:
            self.fresh.setdefault(key, []).append((rows, self.clock()))
        return done

    def overdue(self) -> tuple[list[Waiting], list[Waiting]]:
        """(waits to ask for their misses again, waits that asked `max_asks` times: they leave)."""
        now, again, failed = self.clock(), [], []
        for key in list(self.fresh):
            self.fresh[key] = [(r, t) for r, t in self.fresh[key] if now - t < self.wait_s]
            if not self.fresh[key]:
                del self.fresh[key]
        for w in list(self.waiting.values()):
            if now - w.asked_at < self.wait_s:
                continue
            if w.asks >= self.max_asks:
                failed.append(self.waiting.pop(w.rid))
            else:
                w.asks, w.asked_at = w.asks + 1, now
                again.append(w)
        return again, failed

    def drop(self, rid: str) -> bool:
        return self.waiting.pop(rid, None) is not None

    def __len__(self) -> int:
        return len(self.waiting)
