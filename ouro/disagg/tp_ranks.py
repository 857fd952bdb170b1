"""Disaggregated workers with tensor parallelism (`--disagg XPYD --tp N`, `--role ... --tp N`).

Each worker runs N ranks (`engine.tp_workers`), and prefill rank r sends its own shard of a
request's state to decode rank r: the KDA state of its heads, and the DSA rows, which every rank
holds whole (each decode rank computes with them, so every pair carries them). Rank 0 of each
worker drives its followers with operations:

- prefill: every call on rank 0's `KVSender` (open, layer_ready, finish, fail, abort) is mirrored
  to a follower's own sender, which writes to the decode rank of its index
  (`room["addresses"][r]`); rank 0 hands a request's pages back only once every follower's
  transfer of it has ended (`MirroredSender.release`: an operation, then one all-reduce);
- decode: each follower listens on its own receiver, whose address rank 0 gathers at start
  (`receiver_addresses`); a room opens on a follower when its writer says hello (the room as rank
  0 reserved it travels in the hello, so it cannot race rank 0's operations); before a request
  whose room completed on rank 0 starts decoding, rank 0 asks whether it completed on every
  follower too (`followers_missing`); a room rank 0 frees is freed on the followers.

A follower that dies makes rank 0's next operation or collective raise `TPBroken`: the worker
fails its requests and exits, and the router reports the server unhealthy. Only the tcp transfer
backend runs with --tp.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import torch
import torch.distributed as dist

from ..engine.tp_workers import Follower, main
from .kv_receiver import KVReceiver
from .kv_sender import KVSender

log = logging.getLogger("ouro.disagg.tp")
SENDER_CALLS = ("open", "layer_ready", "finish", "fail", "abort")


def _count(group, bad: bool) -> int:
    """One all-reduce: how many ranks report `bad` (rank 0 waits here for every follower)."""
    flag = torch.tensor([1 if bad else 0])
    dist.all_reduce(flag, group=group)
    return int(flag)


def _on_rank0(tp, collective):
    """A collective of rank 0's: a lost follower makes it raise TPBroken (the worker then stops)."""
    try:
        return collective()
    except RuntimeError as e:
        tp.fail(tp.diagnose(e))


# ---- rank 0 ----
class MirroredSender:
    """Rank 0's `KVSender`, each call mirrored to the followers' senders."""

    def __init__(self, kv: KVSender, tp):
        self.kv, self.tp = kv, tp
        for name in SENDER_CALLS:
            setattr(self, name, self._mirrored(name))

    def _mirrored(self, name):
        def call(*args):
            self.tp.send({"op": "kv", "call": name, "args": list(args)})
            getattr(self.kv, name)(*args)
        return call

    def __getattr__(self, name):          # pieces, jobs, bytes_sent, close: rank 0's own
        return getattr(self.kv, name)

    def release(self, rid: str) -> None:
        """Wait until every follower's transfer of `rid` has ended: its pages may then be reused."""
        self.tp.send({"op": "kv_release", "rid": rid})
        _on_rank0(self.tp, lambda: _count(self.tp.group, False))


def receiver_addresses(tp, address: str) -> list[str]:
    """Every decode rank's receiver address, rank 0's (`address`) first: the followers start theirs."""
    host, port = address.rsplit(":", 1)
    tp.send({"op": "kv_receiver", "host": host})
    ports = [torch.zeros(1, dtype=torch.long) for _ in range(tp.size)]
    _on_rank0(tp, lambda: dist.all_gather(ports, torch.tensor([int(port)]), group=tp.group))
    return [f"{host}:{int(p)}" for p in ports]


def followers_missing(tp, rid: str, timeout_s: float) -> int:
    """How many followers' rooms for `rid` did not complete (within `timeout_s`)."""
    tp.send({"op": "room_ready", "rid": rid, "timeout": timeout_s})
    return _on_rank0(tp, lambda: _count(tp.group, False))


def abort_room(tp, rid: str) -> None:
    tp.send({"op": "room_abort", "rid": rid})


# ---- the followers ----
class FollowerReceiver(KVReceiver):
    """A decode follower's receiver: rooms open on the writer's hello, which carries the room
    rank 0 reserved; rank 0's aborts close them (and keep a later hello out)."""
    GONE_KEPT = 4096        # aborted ids remembered, so a hello arriving after its abort is refused

    def __init__(self, cache, config, address: str, timeout_s: float):
        self.timeout_s = timeout_s
        self.cond = threading.Condition()
        self.ended: dict[str, str | None] = {}     # rid -> None (complete) or why it closed
        self.gone: OrderedDict = OrderedDict()
        super().__init__(cache, config, self._event, address)

    def _event(self, kind, room, reason) -> None:
        with self.cond:
            if room.rid not in self.gone:
                self.ended[room.rid] = None if kind == "ready" else (reason or kind)
                self.cond.notify_all()

    def _frame(self, header, peer) -> None:
        if header.get("type") == "hello" and "room" in header:
            r, rid = header["room"], header.get("rid")
            with self.cond:
                if rid not in self.gone and rid not in self.rooms.rooms:
                    self.rooms.reserve(rid, r["pages"], r["slot"], r["prompt_len"], r["skip_tokens"], self.timeout_s)
        super()._frame(header, peer)

    def wait(self, rid: str, timeout_s: float) -> str | None:
        """None once the room completed (it leaves the table), else why not."""
        with self.cond:
            if not self.cond.wait_for(lambda: rid in self.ended, timeout_s):
                why = f"no complete state within {timeout_s:.0f} s"
            else:
                why = self.ended.pop(rid)
        if why is None:
            self.rooms.take(rid)
        else:
            self.abort(rid)
        return why

    def abort(self, rid: str) -> None:
        with self.cond:
            self.gone[rid] = True
            while len(self.gone) > self.GONE_KEPT:
                self.gone.popitem(last=False)
            self.ended.pop(rid, None)
        self.rooms.abort(rid)


class DisaggFollower(Follower):
    """A follower rank of a disaggregated worker: the plain operations plus its transfers."""
    sender = receiver = None

    def op_kv(self, op):
        """Prefill: rank 0's sender call, on this rank's sender and toward its decode rank."""
        if self.sender is None:
            self.released, self.cond = {}, threading.Condition()
            self.sender = KVSender(self.cache, self.cache.config, self._released, self.timeout_s)
        args = op["args"]
        if op["call"] == "open":
            rid, room, slot, pages = args
            args = [rid, dict(room, address=room["addresses"][self.rank], announce=True), slot, pages]
        getattr(self.sender, op["call"])(*args)

    def _released(self, rid: str, outcome: str) -> None:
        with self.cond:
            self.released[rid] = outcome
            self.cond.notify_all()

    def op_kv_release(self, op):
        rid = op["rid"]
        with self.cond:
            if not self.cond.wait_for(lambda: rid in self.released, 2 * self.timeout_s):
                log.warning("TP rank %d: the transfer of %s did not end in time", self.rank, rid)
            self.released.pop(rid, None)
        _count(self.group, False)

    def op_kv_receiver(self, op):
        self.receiver = FollowerReceiver(self.cache, self.cache.config, f"{op['host']}:0", self.timeout_s)
        port = int(self.receiver.address.rsplit(":", 1)[1])
        dist.all_gather([torch.zeros(1, dtype=torch.long) for _ in range(self.size)], torch.tensor([port]),
                        group=self.group)

    def op_room_ready(self, op):
        why = self.receiver.wait(op["rid"], op["timeout"])
        if why is not None:
            log.warning("TP rank %d: room %s: %s", self.rank, op["rid"], why)
        _count(self.group, why is not None)

    def op_room_abort(self, op):
        self.receiver.abort(op["rid"])

    def close(self) -> None:
        for part in (self.sender, self.receiver):
            if part is not None:
                part.close()


if __name__ == "__main__":
    main(DisaggFollower)
