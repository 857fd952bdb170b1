"""`ouro serve --role prefill|decode`: a worker process, the engine-process protocol over TCP.

The worker binds two ZeroMQ sockets on `--host`: PULL on `--port` (messages in) and PUSH on
`--port + 1` (messages out); a router connects to both. Messages are `serve/messages.py`'s, plus:

router -> decode:  {"type": "reserve", "rid", "prompt_token_ids", "params", "image_hashes" (optional)}
decode -> router:  {"type": "reserved", "rid", "room"}  (or an "error" with status 400 / 503)
router -> prefill: {"type": "add", "rid", "prompt_token_ids", "params", "room", "images" (optional:
                   {"hashes", "coming"} rows from encode workers, or {"hashes", "data"} encoded here)}
prefill -> router: {"type": "need_images", "rid", "hashes"}  (an encoder-cache miss: encode these again)
either:            {"type": "hello"} -> {"type": "ready", ...}  (a router (re)connecting asks)

The decode worker streams "outputs" as `ouro serve`'s engine does; a room that closes without a
complete state becomes an "error" for its request. The prefill worker answers only refusals and
failures; its requests' tokens come from the decode worker. Both send "stats" heartbeats with
their transfer counters, which the router turns into metrics.
"""

from __future__ import annotations

import logging
import os
import time

from ..engine.request import RequestFailed
from ..engine.tp_workers import TPBroken
from ..measure import spans
from ..serve.engine_process import OutputSender, on_trace_message

log = logging.getLogger("ouro.disagg.worker")
HEARTBEAT_S = 0.25
POLL_MS = 20          # the longest sleep: rooms' deadlines and heartbeats are checked this often


def bind_sockets(host: str, port: int, port_file: str | None = None):
    """A worker's (inbox, outbox, port): PULL on `port`, PUSH on `port + 1`, what a router connects
    to. Port 0: a free pair, chosen while bound (a launcher that picked the ports and let them go
    could see another process take one before the worker binds). `port_file`: the port is written
    there once both are bound, for the launcher."""
    import zmq
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 0)
    if port:
        inbox.bind(f"tcp://{host}:{port}")
        outbox.bind(f"tcp://{host}:{port + 1}")
    else:
        for _ in range(100):
            port = inbox.bind_to_random_port(f"tcp://{host}")
            try:
                outbox.bind(f"tcp://{host}:{port + 1}")
                break
            except zmq.ZMQError:
                inbox.unbind(inbox.getsockopt_string(zmq.LAST_ENDPOINT))
        else:
            raise RuntimeError(f"no pair of free ports on {host}")
    if port_file:
        with open(port_file + ".part", "w") as f:
            f.write(str(port))
        os.replace(port_file + ".part", port_file)       # the launcher never reads half a number
    return inbox, outbox, port


def run_worker(role: str, model_dir: str, engine_kwargs: dict, host: str, port: int, backend: str = "tcp",
               bootstrap_port: int = 0, timeout_s: float = 30.0, exit_with_parent: bool = False,
               encoder_cache_bytes: int = 256 << 20, port_file: str | None = None) -> None:
    import torch

    from ..config import EngineConfig
    from ..engine.llm_engine import LLMEngine
    from ..models.loader import has_vision, load_model
    from ..serve.messages import decode, encode, output_to_wire
    from .decode_engine import DecodeEngine
    from .prefill_engine import PrefillEngine

    trace_path = spans.start_from_env(f".{role}.json", process_name=f"ouro {role}")
    torch.set_num_threads(int(os.environ.get("OURO_NUM_THREADS", torch.get_num_threads())))
    inbox, outbox, port = bind_sockets(host, port, port_file)
    cfg = EngineConfig(**engine_kwargs)
    model = load_model(model_dir, dtype=cfg.torch_dtype(), device=cfg.device, kda_chunk_size=cfg.kda_chunk_size)
    engine = LLMEngine(model, None, cfg, model_dir=model_dir, verbose=True, tp_follower_module="ouro.disagg.tp_ranks")
    if role == "prefill":
        worker = PrefillEngine(engine, timeout_s, images=has_vision(model_dir), encoder_cache_bytes=encoder_cache_bytes,
                               host=host)
    else:
        worker = DecodeEngine(engine, backend, f"{host}:{bootstrap_port}", timeout_s)
    info = {"type": "ready", "role": role, "pid": os.getpid(), "plan": engine.plan.describe(min(engine.max_model_len, 4096)),
            "max_model_len": engine.max_model_len, "max_tokens": engine.plan.max_tokens,
            "max_num_seqs": cfg.max_num_seqs, "bootstrap": getattr(worker, "address", None),
            "embeds": worker.embeds.address if getattr(worker, "embeds", None) is not None else None}
    print(f"ouro: {role} worker on tcp://{host}:{port} (+1 out)"
          + (f", KV receiver {worker.address} ({backend})" if role == "decode" else ""), flush=True)
    sender = OutputSender(outbox, encode, output_to_wire)
    sender.send(info)
    try:
        _loop(role, worker, inbox, sender, decode, info, exit_with_parent)
    finally:
        sender.close()
        worker.close()
        if trace_path:
            spans.save_once(trace_path, f"ouro {role}")


def _handle(role, worker, msg, sender, info) -> bool:
    """One message; False: shut down."""
    from ..serve.messages import params_from_wire
    from .decode_engine import NoRoom
    from .state_pieces import LayoutMismatch
    kind, rid = msg.get("type"), msg.get("rid")
    if kind == "hello":
        sender.send(info)
    elif kind == "reserve" and role == "decode":
        try:
            room = worker.reserve(rid, msg["prompt_token_ids"], params_from_wire(msg["params"]), msg.get("image_hashes"))
            sender.send({"type": "reserved", "rid": rid, "room": room})
        except NoRoom as e:
            sender.send({"type": "error", "rid": rid, "status": 503, "message": str(e)})
        except ValueError as e:
            sender.send({"type": "error", "rid": rid, "status": 400, "message": str(e)})
    elif kind == "add" and role == "prefill":
        try:
            worker.add(rid, msg["prompt_token_ids"], params_from_wire(msg["params"]), msg["room"], msg.get("images"))
        except ValueError as e:
            sender.send({"type": "error", "rid": rid, "status": 400, "message": str(e)})
        except LayoutMismatch as e:       # the workers' settings, not the request: a server error
            sender.send({"type": "error", "rid": rid, "status": 500, "message": str(e)})
    elif kind == "abort":
        worker.abort(rid)
    elif kind == "shutdown":
        sender.send({"type": "bye"})
        return False
    elif kind in ("start_trace", "stop_trace"):
        on_trace_message(msg, sender)
    else:
        sender.send({"type": "error", "rid": rid, "status": 400, "message": f"a {role} worker does not take {kind!r}"})
    return True


def _fatal(worker, sender, error) -> None:
    """A tensor-parallel rank is gone: every request fails, and the worker exits (the router then
    sees it gone and reports unhealthy); no clean-up that could wait on a lost peer."""
    log.error("%s", error)
    for rid in list(worker.engine.requests) + list(getattr(worker, "reserved", ())):
        sender.send({"type": "error", "rid": rid, "status": 500, "message": str(error)})
    sender.close()
    sender.outbox.context.destroy(linger=2000)     # the errors reach the router before the exit
    os._exit(1)


def _stats(role, worker) -> dict:
    s = worker.engine.stats()
    if role == "decode":
        s.update(rooms=len(worker.kv.rooms), transfers_completed=worker.transfers["completed"],
                 transfers_failed=worker.transfers["failed"], kv_bytes_received=worker.kv.receiver.bytes_received,
                 transfer_latencies=worker.latencies[:])
        worker.latencies.clear()
    else:
        s.update(held=worker.engine.num_held(), transfer_queue=worker.kv.jobs.qsize(),
                 kv_bytes_sent=worker.kv.bytes_sent, image_waits=len(worker.waits), **worker.waits.cache.stats())
    return s


def _loop(role, worker, inbox, sender, decode, info, exit_with_parent) -> None:
    import zmq
    last_beat, parent = 0.0, os.getppid()
    # sleep until a message or a transfer thread's event (`wakeups`, a WakeQueue): a loop that
    # woke every 2 ms while a room waited took CPU from the prefill beside it on a 2-core machine
    wakeups = worker.wakeups()
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    poller.register(wakeups.fileno(), zmq.POLLIN)
    while True:
        poller.poll(0 if worker.runnable() else POLL_MS)
        wakeups.drain_wakeups()
        while inbox.poll(0):
            try:
                if not _handle(role, worker, decode(inbox.recv()), sender, info):
                    return
            except TPBroken as e:
                _fatal(worker, sender, e)
        try:
            outs = worker.step()
        except RequestFailed as e:
            log.error("request %s failed: %s", e.request_id, e)
            sender.send({"type": "error", "rid": e.request_id, "status": 500, "message": str(e)})
            outs = []
        except TPBroken as e:
            _fatal(worker, sender, e)
        except Exception as e:          # the engine reset the batch; its requests fail rather than loop
            log.exception("the %s step failed", role)
            for rid in list(worker.engine.requests):
                worker.abort(rid)
                sender.send({"type": "error", "rid": rid, "status": 500,
                             "message": f"the {role} worker failed on this request: {type(e).__name__}: {e}"})
            outs = []
        if role == "decode":
            if outs:
                sender.send_outputs(outs)
            while worker.failures:
                rid, why = worker.failures.pop(0)
                sender.send({"type": "error", "rid": rid, "status": 500, "message": why})
        else:                            # image rows to ask for again, requests whose images never came
            while worker.asks:
                rid, hashes = worker.asks.pop(0)
                sender.send({"type": "need_images", "rid": rid, "hashes": hashes})
            while worker.failures:
                rid, why, status = worker.failures.pop(0)
                sender.send({"type": "error", "rid": rid, "status": status, "message": why})
        now = time.monotonic()
        if now - last_beat >= HEARTBEAT_S:
            if exit_with_parent and os.getppid() != parent:
                return
            sender.send({"type": "stats", "role": role, "stats": _stats(role, worker), "time": time.time()})
            last_beat = now
