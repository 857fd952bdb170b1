"""The engine process: scheduler + model behind two ZeroMQ sockets (see `messages.py`).

It owns the LLMEngine; the frontend never touches the model. The loop drains incoming
messages, runs one engine step when there is work, sends the step's outputs as one message,
and sends a stats heartbeat a few times a second (the frontend's health check and /metrics)."""

from __future__ import annotations

import importlib
import logging
import os
import time

log = logging.getLogger("ouro.engine_process")

HEARTBEAT_S = 0.25
MAX_CONSECUTIVE_FAILURES = 3   # a step that keeps failing drops its requests instead of looping


def load_logits_processors(specs, model_dir):
    """'module:Class' names (vLLM's --logits-processors), each built with the checkpoint dir."""
    procs = []
    for spec in specs or ():
        module, _, name = spec.partition(":")
        if not name:
            raise ValueError(f"logits processor {spec!r}: expected 'module:callable'")
        procs.append(getattr(importlib.import_module(module), name)(model_dir))
    return procs


def run_engine(model_dir: str, engine_kwargs: dict, in_addr: str, out_addr: str, logits_processors=()) -> None:
    import zmq
    import torch

    from ..config import EngineConfig
    from ..engine.llm_engine import LLMEngine
    from ..models.loader import load_model
    from .messages import decode, encode, output_to_wire, params_from_wire

    torch.set_num_threads(int(os.environ.get("OURO_NUM_THREADS", torch.get_num_threads())))
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.connect(in_addr)
    outbox.connect(out_addr)
    try:
        prefix = engine_kwargs.pop("enable_prefix_caching", False)
        interval = engine_kwargs.pop("prefix_checkpoint_interval", 1)
        cfg = EngineConfig(**engine_kwargs)
        model = load_model(model_dir, dtype=cfg.torch_dtype(), device=cfg.device, kda_chunk_size=cfg.kda_chunk_size)
        engine = LLMEngine(model, None, cfg, enable_prefix_caching=prefix, checkpoint_interval=interval,
                           verbose=True, logits_processors=load_logits_processors(logits_processors, model_dir))
    except Exception as e:  # tell the frontend why, then exit
        outbox.send(encode({"type": "fatal", "message": f"{type(e).__name__}: {e}"}))
        time.sleep(0.2)
        raise SystemExit(1)
    outbox.send(encode({"type": "ready", "pid": os.getpid(), "plan": engine.plan.describe(min(engine.max_model_len, 4096)),
                        "max_model_len": engine.max_model_len, "max_tokens": engine.plan.max_tokens,
                        "max_num_seqs": cfg.max_num_seqs}))
    last_beat, failures, parent = 0.0, 0, os.getppid()
    while True:
        timeout = 0 if engine.has_unfinished() else int(HEARTBEAT_S * 1000)
        while inbox.poll(timeout):
            timeout = 0
            msg = decode(inbox.recv())
            kind = msg.get("type")
            if kind == "add":
                try:
                    engine.add_request({"prompt_token_ids": msg["prompt_token_ids"]}, params_from_wire(msg["params"]),
                                       msg["rid"])
                except ValueError as e:
                    outbox.send(encode({"type": "error", "rid": msg["rid"], "message": str(e), "status": 400}))
            elif kind == "abort":
                engine.abort(msg["rid"])
            elif kind == "shutdown":
                outbox.send(encode({"type": "bye"}))
                return
        if engine.has_unfinished():
            try:
                outs = engine.step()
                failures = 0
            except Exception as e:   # the engine reset the batch for recompute; don't loop forever
                failures += 1
                log.exception("engine step failed (%d in a row)", failures)
                if failures >= MAX_CONSECUTIVE_FAILURES:
                    for rid in list(engine.requests):
                        engine.abort(rid)
                        outbox.send(encode({"type": "error", "rid": rid, "status": 500,
                                            "message": f"the engine failed on this request: {type(e).__name__}: {e}"}))
                    failures = 0
                outs = []
            if outs:
                outbox.send(encode({"type": "outputs", "items": [output_to_wire(o) for o in outs]}))
        now = time.monotonic()
        if now - last_beat >= HEARTBEAT_S:
            if os.getppid() != parent:   # the frontend is gone (killed): nobody to serve
                return
            outbox.send(encode({"type": "stats", "stats": engine.stats(), "time": time.time()}))
            last_beat = now
