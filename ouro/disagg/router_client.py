"""The router's handle on its prefill and decode workers: the frontend's `EngineClient` interface
(start, add, abort, release, traces, health, stats), so `ouro router` is `ouro serve`'s HTTP front
over a disaggregated deployment.

A request: `reserve` on a decode worker (its room: slot, pages, where to write), then `add` on a
prefill worker with that room; the decode worker streams the tokens back. A refusal on either side
fails the request with that side's status (400, 503), and a request the prefill worker refused
has its room released on the decode side. A worker whose heartbeats stop (or whose process, when
the router started it, exits) is dead: its requests fail with 503 at once, and rooms waiting on a
dead prefill worker are aborted on the decode side. Workers are picked round robin.

A request with images goes to an encode worker first (`image_routes`): its rows reach the prefill
worker before a room is reserved; text-only requests never touch the encode workers, and an
encode worker down fails image requests only (/health stays 200 while prefill and decode are up).
Without encode workers the prefill worker encodes the images itself.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import zmq
import zmq.asyncio

from ..serve.protocol import ServeError
from ..serve.engine_client import EngineUnavailable
from ..engine.multimodal import bytes_hash
from ..serve.messages import decode, encode, images_to_wire, params_to_wire
from .image_routes import ImageRoutes
from .router_stats import merge_stats

HEARTBEAT_TIMEOUT_S = 10.0     # a worker beats between steps: a long prefill step must not look like death
RESERVE_TIMEOUT_S = 30.0
ENCODE_TIMEOUT_S = 120.0       # an encode worker's answer (its heartbeats say sooner when it is gone)
ROLES = ("encode", "prefill", "decode")


class WorkerLink:
    """Two sockets to one worker (PUSH to its port, PULL from port + 1), its info and heartbeat."""

    def __init__(self, ctx, address: str, role: str, proc=None):
        self.address, self.role, self.proc = address, role, proc
        self.pull = ctx.socket(zmq.PULL)
        self.pull.connect(f"tcp://{self._host_port(1)}")
        self.reset_push(ctx)
        self.info: dict = {}
        self.stats: dict = {}
        self.last_beat = 0.0
        self.dead: str | None = None

    def _host_port(self, offset: int = 0) -> str:
        host, port = self.address.rsplit(":", 1)
        return f"{host}:{int(port) + offset}"

    def reset_push(self, ctx) -> None:
        """A fresh PUSH socket: ZeroMQ would otherwise keep what was sent to a dead worker and
        hand it to the next process on that port, which would prefill requests long failed."""
        old = getattr(self, "push", None)
        if old is not None:
            old.close(linger=0)
        self.push = ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.connect(f"tcp://{self._host_port()}")

    async def send(self, msg: dict) -> None:
        await self.push.send(encode(msg))


class DisaggClient:
    def __init__(self, prefill: list[str], decode: list[str], on_stats=None, procs: dict | None = None,
                 heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S, encode: list[str] = (), model_dir=None):
        self.addresses = {"encode": list(encode), "prefill": list(prefill), "decode": list(decode)}
        self.images = ImageRoutes()
        self.procs = procs or {}                # address -> a process the router started (--disagg)
        self.on_stats = on_stats or (lambda stats: None)
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.state, self.dead_reason = "starting", ""
        self.info: dict = {}
        self.stats: dict = {}
        self.queues: dict[str, asyncio.Queue] = {}
        self.routes: dict[str, tuple[WorkerLink, WorkerLink]] = {}
        self._reserving: dict[str, asyncio.Future] = {}
        self._traces: dict[WorkerLink, asyncio.Future] = {}
        self._tasks: list[asyncio.Task] = []
        self._side_tasks: set[asyncio.Task] = set()
        self.links: list[WorkerLink] = []

    # ---- life cycle ----
    async def start(self, timeout: float = 600.0) -> None:
        self.ctx = zmq.asyncio.Context()
        self.links = [WorkerLink(self.ctx, a, role, self.procs.get(a)) for role in ROLES for a in self.addresses[role]]
        self._rr = {role: itertools.cycle([lk for lk in self.links if lk.role == role]) for role in ROLES
                    if self.addresses[role]}
        deadline = time.monotonic() + timeout
        for link in self.links:
            while not link.info:
                await link.send({"type": "hello"})
                if link.proc is not None and link.proc.poll() is not None:
                    raise EngineUnavailable(f"the {link.role} worker {link.address} exited during start-up "
                                            f"(code {link.proc.returncode})")
                if await link.pull.poll(500):
                    msg = decode(await link.pull.recv())
                    if msg["type"] == "ready":
                        link.info, link.last_beat = msg, time.monotonic()
                if time.monotonic() > deadline:
                    raise EngineUnavailable(f"the {link.role} worker {link.address} did not answer within {timeout:.0f} s")
        decoders = [lk.info for lk in self.links if lk.role == "decode"]
        prefillers = [lk.info for lk in self.links if lk.role == "prefill"]
        self.info = {"pid": ",".join(str(i["pid"]) for i in prefillers + decoders),
                     "plan": "decode: " + decoders[0]["plan"],
                     "max_model_len": min(i["max_model_len"] for i in prefillers + decoders),
                     "max_tokens": min(i["max_tokens"] for i in decoders)}
        self.state = "ready"
        self._tasks = [asyncio.create_task(self._reader(lk)) for lk in self.links]
        self._tasks.append(asyncio.create_task(self._watchdog()))

    async def shutdown(self, timeout: float = 5.0) -> None:
        for t in self._tasks:
            t.cancel()
        for link in self.links:
            try:
                await link.send({"type": "shutdown"})
            except zmq.ZMQError:
                pass
        self._fail_all("the server is shutting down", 503)
        self.state, self.dead_reason = "dead", "the server has shut down"
        if hasattr(self, "ctx"):
            await asyncio.sleep(0.05)
            self.ctx.destroy(linger=0)

    def cleanup(self) -> None:
        pass

    @property
    def healthy(self) -> bool:
        """Prefill and decode workers all up (an encode worker down fails image requests only)."""
        return self.state == "ready" and all(lk.dead is None for lk in self.links if lk.role != "encode")

    def _encoder(self) -> WorkerLink | None:
        """The next living encode worker, round robin, or None."""
        for _ in range(len(self.addresses["encode"])):
            link = next(self._rr["encode"])
            if link.dead is None:
                return link
        return None

    # ---- requests ----
    async def add(self, rid: str, prompt_ids: list[int], params, queue: asyncio.Queue | None = None,
                  images: list | None = None) -> asyncio.Queue:
        if not self.healthy:
            raise EngineUnavailable(self.dead_reason or "the workers are not ready")
        if params.prompt_logprobs is not None or params.max_tokens == 0:   # the prefill side would have to send them
            raise ServeError(400, "prompt logprobs (echo with logprobs, prompt_logprobs) and max_tokens 0 are "
                                       "not available through the prefill/decode router; ask a single server")
        p, d = next(self._rr["prefill"]), next(self._rr["decode"])
        if images and p.info.get("embeds") is None:
            raise ServeError(400, "this model takes text only: the prefill workers have no image input")
        q = queue if queue is not None else asyncio.Queue()
        self.queues[rid] = q
        wire = params_to_wire(params)
        hashes, image_part = None, None
        if images:                                   # encode first: nothing is reserved while it runs
            hashes = [bytes_hash(raw) for raw in images]
            self.images.hold(rid, p, images, hashes)
            if self.addresses["encode"]:
                coming = await self._encode(rid, p, self.images.unsent(p, hashes))
                if coming is None or rid not in self.queues:     # failed (the error is queued) or aborted
                    self.images.drop(rid)
                    return q
                image_part = {"hashes": hashes, "coming": coming}
            else:                                    # no encode worker: the prefill worker encodes them
                image_part = {"hashes": hashes, "data": images_to_wire(images)}
        fut = self._reserving[rid] = asyncio.get_running_loop().create_future()
        await d.send({"type": "reserve", "rid": rid, "prompt_token_ids": prompt_ids, "params": wire,
                      "image_hashes": hashes})
        try:
            answer = await asyncio.wait_for(fut, RESERVE_TIMEOUT_S)
        except asyncio.TimeoutError:
            answer = {"error": f"the decode worker {d.address} did not answer", "status": 503}
        finally:
            self._reserving.pop(rid, None)
        if "error" in answer:
            q.put_nowait({"rid": rid, "error": answer["error"], "status": answer["status"]})
            await d.send({"type": "abort", "rid": rid})     # in case it reserved after all
            self.images.drop(rid)
            return q
        if rid not in self.queues:                          # aborted while reserving
            await d.send({"type": "abort", "rid": rid})
            self.images.drop(rid)
            return q
        self.routes[rid] = (p, d)
        await p.send({"type": "add", "rid": rid, "prompt_token_ids": prompt_ids, "params": wire, "room": answer["room"],
                      "images": image_part})
        return q

    async def _encode(self, rid: str, p: WorkerLink, todo: list[int]) -> list[str] | None:
        """Have an encode worker send the images `todo` (indices) to `p`; returns their hashes once
        sent (the prefill worker waits for them), or None with the request's error queued."""
        held = self.images.held.get(rid)
        if not todo or held is None:
            return []
        answer = await self.images.encode(rid, todo, self._encoder, ENCODE_TIMEOUT_S)
        if "error" in answer:
            q = self.queues.pop(rid, None)
            if q is not None:
                q.put_nowait({"rid": rid, "error": answer["error"], "status": answer["status"]})
            return None
        return answer["hashes"]

    async def abort(self, rid: str) -> None:
        self.queues.pop(rid, None)
        await self.images.abort(rid)
        route = self.routes.pop(rid, None)
        if route is not None:
            for link in route:
                if link.dead is None:
                    await link.send({"type": "abort", "rid": rid})

    def release(self, rid: str) -> None:
        self.queues.pop(rid, None)
        self.images.drop(rid)
        self.routes.pop(rid, None)

    # ---- tracing on demand: every worker records; stop returns all their events ----
    async def start_trace(self, heartbeat: bool = False) -> None:
        for link in self.links:
            await link.send({"type": "start_trace", "heartbeat": bool(heartbeat)})

    async def stop_trace(self, timeout: float = 30.0) -> list[dict]:
        loop = asyncio.get_running_loop()
        self._traces = {lk: loop.create_future() for lk in self.links}
        for link in self.links:
            await link.send({"type": "stop_trace"})
        try:
            got = await asyncio.wait_for(asyncio.gather(*self._traces.values()), timeout)
        except asyncio.TimeoutError:
            raise EngineUnavailable(f"a worker sent no trace within {timeout:.0f} s") from None
        return [e for events in got for e in events]

    # ---- background ----
    async def _reader(self, link: WorkerLink) -> None:
        while True:
            msg = decode(await link.pull.recv())
            kind, rid = msg["type"], msg.get("rid")
            if kind == "outputs":
                for item in msg["items"]:
                    self.images.drop(item["rid"])           # prefilled: its images are no longer needed
                    q = self.queues.get(item["rid"])
                    if q is not None:
                        q.put_nowait(item)
                    if item["finished"]:
                        self.routes.pop(item["rid"], None)
            elif kind == "reserved":
                fut = self._reserving.get(rid)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif kind == "encoded":
                self.images.encoded(link, msg)
            elif kind == "need_images":           # an encoder-cache miss: encode again, off this reader
                task = asyncio.create_task(self._reencode(link, rid, msg.get("hashes", [])))
                self._side_tasks.add(task)
                task.add_done_callback(self._side_tasks.discard)
            elif kind == "error":
                if link.role == "encode" and self.images.encode_failed(link, rid, msg):
                    continue
                await self._error(link, rid, msg["message"], msg.get("status", 500))
            elif kind == "stats":
                link.stats, link.last_beat = msg["stats"], time.monotonic()
                self._merge_stats(link.stats.pop("transfer_latencies", []))
            elif kind == "ready":          # a worker (re)started at this address: it serves again
                link.info, link.last_beat, link.dead = msg, time.monotonic(), None
                if all(lk.dead is None for lk in self.links):
                    self.dead_reason = ""
            elif kind == "trace":
                fut = self._traces.get(link)
                if fut is not None and not fut.done():
                    fut.set_result(msg["events"])

    async def _error(self, link: WorkerLink, rid: str, message: str, status: int) -> None:
        fut = self._reserving.get(rid)
        if fut is not None and not fut.done():
            fut.set_result({"error": message, "status": status})
            return
        q = self.queues.pop(rid, None)
        if q is not None:
            q.put_nowait({"rid": rid, "error": message, "status": status})
        self.images.drop(rid)
        route = self.routes.pop(rid, None)
        if route is not None:            # the other sides let go too: the room is released, the prefill stops
            for other in route:
                if other is not link and other.dead is None:
                    await other.send({"type": "abort", "rid": rid})

    async def _reencode(self, p: WorkerLink, rid: str, hashes: list[str]) -> None:
        """A prefill worker lacks these rows: an encode worker sends them again (no encode worker
        up, or the request's images already let go: the request fails)."""
        self.images.forget(p, hashes)
        todo = self.images.indices(rid, hashes)
        if todo is None or rid not in self.routes:
            return
        answer = await self.images.encode(rid, todo, self._encoder, ENCODE_TIMEOUT_S)
        if "error" in answer and rid in self.routes:
            await self._error(p, rid, answer["error"], answer["status"])

    def _merge_stats(self, latencies: list[float]) -> None:
        self.stats = merge_stats(self.links, latencies)
        self.on_stats(self.stats)

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            now = time.monotonic()
            for link in self.links:
                if link.dead is not None:
                    continue
                if link.proc is not None and link.proc.poll() is not None:
                    link.dead = f"the {link.role} worker {link.address} exited (code {link.proc.returncode})"
                elif now - link.last_beat > self.heartbeat_timeout_s:
                    link.dead = f"the {link.role} worker {link.address} stopped answering"
                if link.dead is not None:
                    self.dead_reason = link.dead
                    await self._lost(link)

    async def _lost(self, link: WorkerLink) -> None:
        """Every request through a dead worker fails now; rooms it would have filled are released;
        nothing queued for it reaches the worker that next starts on its address."""
        link.reset_push(self.ctx)
        if link.role == "encode":       # its jobs go to another encode worker, or fail
            await self.images.lost(link, self._encoder)
            return
        for rid, (p, d) in list(self.routes.items()):
            if link in (p, d):
                await self._error(link, rid, link.dead, 503)
        if link.role == "decode":
            for rid, fut in list(self._reserving.items()):
                if not fut.done():
                    fut.set_result({"error": link.dead, "status": 503})

    def _fail_all(self, reason: str, status: int) -> None:
        for rid, q in self.queues.items():
            q.put_nowait({"rid": rid, "error": reason, "status": status})
        self.queues.clear()
        for fut in self._reserving.values():
            if not fut.done():
                fut.set_result({"error": reason, "status": status})
        for fut in self._traces.values():
            if not fut.done():
                fut.set_exception(EngineUnavailable(reason))
