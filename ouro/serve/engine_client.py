"""The frontend's handle on the engine process: spawn it, talk to it over ZeroMQ (asyncio),
route its outputs to per-request queues, and notice when it dies (every waiting request then
gets an error at once: nothing hangs)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import tempfile
import time

import zmq
import zmq.asyncio

from .messages import decode, encode, images_to_wire, params_to_wire


class EngineUnavailable(RuntimeError):
    """The engine process is not running (starting, dead or shut down)."""


class EngineClient:
    def __init__(self, model_dir: str, engine_kwargs: dict, logits_processors=(), on_stats=None):
        self.model_dir, self.engine_kwargs, self.logits_processors = str(model_dir), dict(engine_kwargs), list(logits_processors)
        self.on_stats = on_stats or (lambda stats: None)
        self.state = "starting"          # starting -> ready -> dead
        self.dead_reason = ""
        self.info: dict = {}
        self.stats: dict = {}
        self.last_beat = 0.0
        self.queues: dict[str, asyncio.Queue] = {}
        self.proc: mp.Process | None = None
        self._dir = tempfile.mkdtemp(prefix="ouro-ipc-")
        self._tasks: list[asyncio.Task] = []
        self._trace_wait: asyncio.Future | None = None   # a stop_trace waiting for the engine's events

    # ---- life cycle ----
    async def start(self, timeout: float = 600.0) -> None:
        from .engine_process import run_engine
        self.ctx = zmq.asyncio.Context()
        self.push, self.pull = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        in_addr, out_addr = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self.push.bind(in_addr)
        self.pull.bind(out_addr)
        self.push.setsockopt(zmq.LINGER, 0)
        spawn = mp.get_context("spawn")
        self.proc = spawn.Process(target=run_engine, name="ouro-engine", daemon=True,
                                  args=(self.model_dir, self.engine_kwargs, in_addr, out_addr, self.logits_processors))
        self.proc.start()
        deadline = time.monotonic() + timeout
        while True:
            if not self.proc.is_alive():
                raise EngineUnavailable(f"the engine process exited during start-up (code {self.proc.exitcode})")
            if await self.pull.poll(200):
                msg = decode(await self.pull.recv())
                if msg["type"] == "ready":
                    self.info = msg
                    break
                if msg["type"] == "fatal":
                    raise EngineUnavailable(msg["message"])
            if time.monotonic() > deadline:
                raise EngineUnavailable(f"the engine process did not start within {timeout:.0f} s")
        self.state, self.last_beat = "ready", time.monotonic()
        self._tasks = [asyncio.create_task(self._reader()), asyncio.create_task(self._watchdog())]

    async def shutdown(self, timeout: float = 5.0) -> None:
        for t in self._tasks:
            t.cancel()
        if not hasattr(self, "ctx"):   # never started
            self.state = "dead"
            return
        if self.proc is not None and self.proc.is_alive():
            try:
                await self.push.send(encode({"type": "shutdown"}))
            except zmq.ZMQError:
                pass
            self.proc.join(timeout)
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join(2)
        self._fail_all("the server is shutting down")
        self.state, self.dead_reason = "dead", "the server has shut down"
        self.ctx.destroy(linger=0)

    @property
    def healthy(self) -> bool:
        return self.state == "ready" and self.proc is not None and self.proc.is_alive()

    # ---- requests ----
    async def add(self, rid: str, prompt_ids: list[int], params, queue: asyncio.Queue | None = None,
                  images: list | None = None) -> asyncio.Queue:
        """Send a request; its outputs (and errors) arrive on `queue` (shared by a request's n choices).
        `images`: encoded image bytes, in prompt order (base64 on the JSON wire)."""
        if not self.healthy:
            raise EngineUnavailable(self.dead_reason or "the engine is not ready")
        q = queue if queue is not None else asyncio.Queue()
        self.queues[rid] = q
        msg = {"type": "add", "rid": rid, "prompt_token_ids": prompt_ids, "params": params_to_wire(params)}
        if images:
            msg["images"] = images_to_wire(images)
        await self.push.send(encode(msg))
        return q

    async def abort(self, rid: str) -> None:
        if self.queues.pop(rid, None) is not None and self.healthy:
            await self.push.send(encode({"type": "abort", "rid": rid}))

    def release(self, rid: str) -> None:
        """Forget a finished request's queue."""
        self.queues.pop(rid, None)

    # ---- tracing on demand ----
    async def start_trace(self, heartbeat: bool = False) -> None:
        """The engine clears its spans and records from its next message on (messages on one
        socket arrive in order, so every request sent after this is traced)."""
        if not self.healthy:
            raise EngineUnavailable(self.dead_reason or "the engine is not ready")
        await self.push.send(encode({"type": "start_trace", "heartbeat": bool(heartbeat)}))

    async def stop_trace(self, timeout: float = 30.0) -> list[dict]:
        """Stop the engine's recording; returns its Chrome trace events."""
        if not self.healthy:
            raise EngineUnavailable(self.dead_reason or "the engine is not ready")
        self._trace_wait = asyncio.get_running_loop().create_future()
        try:
            await self.push.send(encode({"type": "stop_trace"}))
            return await asyncio.wait_for(asyncio.shield(self._trace_wait), timeout)
        except asyncio.TimeoutError:
            raise EngineUnavailable(f"the engine sent no trace within {timeout:.0f} s") from None
        finally:
            self._trace_wait = None

    # ---- background ----
    async def _reader(self) -> None:
        while True:
            msg = decode(await self.pull.recv())
            kind = msg["type"]
            if kind == "outputs":
                for item in msg["items"]:
                    q = self.queues.get(item["rid"])
                    if q is not None:
                        q.put_nowait(item)
            elif kind == "error":
                q = self.queues.get(msg["rid"])
                if q is not None:
                    q.put_nowait({"rid": msg["rid"], "error": msg["message"], "status": msg.get("status", 500)})
            elif kind == "stats":
                self.stats, self.last_beat = msg["stats"], time.monotonic()
                self.on_stats(self.stats)
            elif kind == "trace":
                if self._trace_wait is not None and not self._trace_wait.done():
                    self._trace_wait.set_result(msg["events"])
            elif kind == "fatal":        # the engine cannot compute any more (a tensor-parallel rank is gone)
                self.state, self.dead_reason = "dead", msg["message"]
                self._fail_all(self.dead_reason)

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            if not self.proc.is_alive():
                self.state = "dead"
                self.dead_reason = f"the engine process died (exit code {self.proc.exitcode})"
                self._fail_all(self.dead_reason)
                return

    def _fail_all(self, reason: str) -> None:
        for rid, q in self.queues.items():
            q.put_nowait({"rid": rid, "error": reason, "status": 503})
        self.queues.clear()
        if self._trace_wait is not None and not self._trace_wait.done():
            self._trace_wait.set_exception(EngineUnavailable(reason))

    def cleanup(self) -> None:
        for name in ("in", "out"):
            try:
                os.unlink(os.path.join(self._dir, name))
            except OSError:
                pass
        try:
            os.rmdir(self._dir)
        except OSError:
            pass
