"""The engine process: scheduler + model behind two ZeroMQ sockets (see `messages.py`).

It owns the LLMEngine; the frontend never touches the model. The loop drains incoming
messages, runs one engine step when there is work, hands the step's outputs to the sender thread
(which encodes and sends them as one message while the next step computes), and sends a stats
heartbeat a few times a second (the frontend's health check and /metrics)."""

from __future__ import annotations

import importlib
import logging
import os
import queue
import threading
import time

from ..measure import spans
from ..measure.spans import span
from ..engine.request import RequestFailed
from ..engine.tp_workers import TPBroken

log = logging.getLogger("ouro.engine_process")

HEARTBEAT_S = 0.25
MAX_CONSECUTIVE_FAILURES = 3   # a step that keeps failing drops its requests instead of looping
# A burst of requests reaching an idle engine is prefilled as one step: after the first request the
# loop waits for the next one for up to GATHER_GAP_MS, and for at most OURO_IDLE_GATHER_MS in all
# (0: no wait). Stepping at once prefilled the first request of a burst alone while the frontend
# forwarded the rest: 8 x 128-token requests arriving within 16 ms ran as a 1-request step (62 ms)
# and then a 7-request one (258 ms), so seven of them waited for both; together they take ~270 ms.
# A lone request pays at most GATHER_GAP_MS.
GATHER_GAP_MS = 5
IDLE_GATHER_MS = 25


def idle_gather_ms() -> int:
    """The longest an idle engine waits to gather a burst (`OURO_IDLE_GATHER_MS`, default 25)."""
    value = os.environ.get("OURO_IDLE_GATHER_MS", str(IDLE_GATHER_MS))
    try:
        ms = int(value)
    except ValueError:
        raise ValueError(f"OURO_IDLE_GATHER_MS must be a whole number of milliseconds, got {value!r}") from None
    if ms < 0:
        raise ValueError(f"OURO_IDLE_GATHER_MS must be 0 or more, got {ms}")
    return ms


def load_logits_processors(specs, model_dir):
    """'module:Class' names (vLLM's --logits-processors), each built with the checkpoint dir."""
    procs = []
    for spec in specs or ():
        module, _, name = spec.partition(":")
        if not name:
            raise ValueError(f"logits processor {spec!r}: expected 'module:callable'")
        procs.append(getattr(importlib.import_module(module), name)(model_dir))
    return procs


def _next_item(q: queue.Queue):
    """The sender's wait for work: a blocking get, which releases the GIL while it waits."""
    return q.get()


class OutputSender:
    """Encodes and sends the engine's messages on its own thread, so the next step's compute
    overlaps the send. The only user of the outbox socket once started (ZeroMQ sockets are not
    thread-safe)."""

    def __init__(self, outbox, encode, output_to_wire):
        self.outbox, self.encode, self.output_to_wire = outbox, encode, output_to_wire
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name="ouro-output-sender", daemon=True)
        self.thread.start()

    def send(self, msg: dict) -> None:
        self.queue.put(msg)

    def send_outputs(self, outs) -> None:
        self.queue.put(outs)      # RequestOutputs are snapshots: safe to encode on the other thread

    def close(self, timeout: float = 5.0) -> None:
        self.queue.put(None)
        self.thread.join(timeout)

    def _loop(self) -> None:
        while True:
            item = _next_item(self.queue)
            if item is None:
                return
            try:
                with span("send", cat="transfer"):
                    if isinstance(item, list):
                        item = {"type": "outputs", "items": [self.output_to_wire(o) for o in item]}
                    self.outbox.send(self.encode(item))
            except Exception:   # one bad message must not silence every later one
                log.exception("could not send %s", item.get("type") if isinstance(item, dict) else "outputs")


def run_engine(model_dir: str, engine_kwargs: dict, in_addr: str, out_addr: str, logits_processors=()) -> None:
    import zmq
    import torch

    from ..config import EngineConfig
    from ..engine.llm_engine import LLMEngine
    from ..models.loader import load_model
    from .messages import decode, encode, output_to_wire, params_from_wire

    trace_path = spans.start_from_env(".engine.json", process_name="ouro engine")
    torch.set_num_threads(int(os.environ.get("OURO_NUM_THREADS", torch.get_num_threads())))
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.connect(in_addr)
    outbox.connect(out_addr)
    try:
        gather_s = idle_gather_ms() / 1e3
        cfg = EngineConfig(**engine_kwargs)          # checked by the frontend before it started this process
        model = load_model(model_dir, dtype=cfg.torch_dtype(), device=cfg.device, kda_chunk_size=cfg.kda_chunk_size)
        engine = LLMEngine(model, None, cfg, model_dir=model_dir, verbose=True, options_checked=True,
                           logits_processors=load_logits_processors(logits_processors, model_dir))
    except Exception as e:  # tell the frontend why, then exit
        outbox.send(encode({"type": "fatal", "message": f"{type(e).__name__}: {e}"}))
        time.sleep(0.2)
        raise SystemExit(1)
    outbox.send(encode({"type": "ready", "pid": os.getpid(), "plan": engine.plan.describe(min(engine.max_model_len, 4096)),
                        "max_model_len": engine.max_model_len, "max_tokens": engine.plan.max_tokens,
                        "max_num_seqs": cfg.max_num_seqs}))
    sender = OutputSender(outbox, encode, output_to_wire)
    try:
        _loop(engine, inbox, sender, decode, params_from_wire, gather_s)
    finally:
        sender.close()
        if trace_path:
            spans.save_once(trace_path, "ouro engine")


def on_trace_message(msg: dict, sender) -> None:
    """Tracing on demand (the frontend's /start_trace and /stop_trace): between two steps, so
    requests in flight carry on; the events go back as one message, encoded on the sender thread."""
    from ..measure import heartbeat
    if msg["type"] == "start_trace":
        spans.clear()
        heartbeat.clear()
        spans.enable()
        if msg.get("heartbeat"):
            heartbeat.start()
        return
    heartbeat.stop()
    spans.disable()
    sender.send({"type": "trace", "events": spans.chrome_events(process_name="ouro engine")})
    spans.clear()
    heartbeat.clear()


def _loop(engine, inbox, sender, decode, params_from_wire, gather_s: float = 0.0) -> None:
    from .messages import prompt_from_wire
    last_beat, failures, parent = 0.0, 0, os.getppid()
    busy_since = None                 # the trace's "pending" spans: when the engine has work
    while True:
        if busy_since is not None and not engine.has_unfinished():
            spans.record("pending", "pending", busy_since, spans.now_ns())
            busy_since = None
        idle = not engine.has_unfinished()
        timeout = 0 if not idle else int(HEARTBEAT_S * 1000)
        gather_end = None             # while an idle engine gathers a burst: when it stops waiting
        while inbox.poll(timeout):
            timeout = 0
            t_recv = spans.now_ns()
            msg = decode(inbox.recv())
            kind = msg.get("type")
            if idle and kind == "add" and gather_end is None and gather_s > 0:
                gather_end = time.monotonic() + gather_s
            if gather_end is not None:    # wait a little for the burst's next request
                left = gather_end - time.monotonic()
                timeout = max(1, round(1e3 * min(GATHER_GAP_MS / 1e3, left))) if left > 0 else 0
            if kind == "add":
                try:
                    engine.add_request(prompt_from_wire(msg), params_from_wire(msg["params"]), msg["rid"])
                except ValueError as e:
                    sender.send({"type": "error", "rid": msg["rid"], "message": str(e), "status": 400})
            elif kind == "abort":
                engine.abort(msg["rid"])
            elif kind == "shutdown":
                sender.send({"type": "bye"})
                return
            elif kind in ("start_trace", "stop_trace"):
                if busy_since is not None:    # the busy period so far belongs to the trace that ends
                    spans.record("pending", "pending", busy_since, spans.now_ns())
                    busy_since = spans.now_ns()
                on_trace_message(msg, sender)
            spans.record("recv", "io", t_recv, spans.now_ns())
        if busy_since is None and engine.has_unfinished():
            busy_since = spans.now_ns()
        if engine.has_unfinished():
            try:
                outs = engine.step()
                failures = 0
            except RequestFailed as e:   # one request lost (released by the engine); the rest go on
                log.error("request %s failed: %s", e.request_id, e)
                sender.send({"type": "error", "rid": e.request_id, "status": e.status, "message": str(e)})
                outs = []
            except TPBroken as e:    # a tensor-parallel rank is gone: fail everything and stop (unhealthy)
                log.error("%s", e)
                for rid in list(engine.requests):
                    engine.abort(rid)
                    sender.send({"type": "error", "rid": rid, "status": 500, "message": str(e)})
                sender.send({"type": "fatal", "message": str(e)})
                sender.close()
                engine.close()
                os._exit(1)          # nothing of this process is usable: no clean-up that could wait on a peer
            except Exception as e:   # the engine reset the batch for recompute; don't loop forever
                failures += 1
                log.exception("engine step failed (%d in a row)", failures)
                if failures >= MAX_CONSECUTIVE_FAILURES:
                    for rid in list(engine.requests):
                        engine.abort(rid)
                        sender.send({"type": "error", "rid": rid, "status": 500,
                                     "message": f"the engine failed on this request: {type(e).__name__}: {e}"})
                    failures = 0
                outs = []
            if outs:
                sender.send_outputs(outs)
        now = time.monotonic()
        if now - last_beat >= HEARTBEAT_S:
            if os.getppid() != parent:   # the frontend is gone (killed): nobody to serve
                return
            sender.send({"type": "stats", "stats": engine.stats(), "time": time.time()})
            last_beat = now
