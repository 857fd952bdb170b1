"""The serve scenarios of `scenarios.py`: streamed completions against a real `ouro serve`,
either one started here with `--trace FILE` (`serve`) or one already running, traced on demand
through its /start_trace and /stop_trace routes (`serve_url`). Both measure ttft_p50_ms and
tpot_ms and return the merged trace of the frontend and the engine process."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

from ..bench.server_process import wait_ready  # noqa: F401 (re-exported)
from ..parallel.groups import free_port


def serve(model_dir, requests: int = 4, max_tokens: int = 8, trace_out: str | None = None,
          heartbeat: bool = True, timeout: float = 120.0) -> dict:
    """A real `ouro serve --trace FILE` on 127.0.0.1; streamed completions give TTFT and TPOT."""
    from .workload import prompts
    from ..measure.chrome_trace import load
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="ouro-timeline-")
    trace = trace_out or os.path.join(tmp, "trace.json")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OURO_NUM_THREADS": "1",
           "OURO_TRACE_HEARTBEAT": "1" if heartbeat else "0"}
    env.pop("OURO_TRACE", None)
    log = open(os.path.join(tmp, "server.log"), "w+")
    cmd = [sys.executable, "-c", SERVE_MAIN, "serve", "--model", str(model_dir), "--port", str(port),
           "--max-memory", str(64 << 20), "--page-size", "16", "--trace", trace, "--shutdown-timeout", "2"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(proc, base, timeout, log)
        stream_completions(base, prompts(1, seed=5), 2, LOAD_SECONDS / 4)      # warm-up
        records = stream_completions(base, prompts(requests, seed=6), max_tokens, LOAD_SECONDS)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if not os.path.exists(trace):
        log.seek(0)
        raise RuntimeError(f"ouro serve wrote no trace {trace}:\n{log.read()[-2000:]}")
    return {"measurements": _latencies(records), "trace": load(trace), "trace_path": trace}


def serve_url(base: str, requests: int = 4, max_tokens: int = 8, trace_out: str | None = None,
              heartbeat: bool = True, api_key: str | None = None) -> dict:
    """The serve scenario against a running server: /start_trace, the streamed completions,
    /stop_trace. Same measurements and trace as `serve` (the server's own model and options)."""
    import json

    import httpx

    from .workload import prompts
    base = base.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    stream_completions(base, prompts(1, seed=5), 2, LOAD_SECONDS, headers)          # warm-up, untraced
    _trace_call(httpx, base, "/start_trace", headers, {"heartbeat": heartbeat})
    try:
        if heartbeat:
            time.sleep(0.05)                              # idle samples: the heartbeat's baseline
        records = stream_completions(base, prompts(requests, seed=6), max_tokens, LOAD_SECONDS, headers)
    finally:
        doc = _trace_call(httpx, base, "/stop_trace", headers)
    if trace_out:
        with open(trace_out, "w") as fh:
            json.dump(doc, fh)
    return {"measurements": _latencies(records), "trace": doc, "trace_path": trace_out}


def _trace_call(httpx, base: str, route: str, headers: dict, body: dict | None = None) -> dict:
    try:
        r = httpx.post(base + route, json=body, headers=headers, timeout=60)
    except httpx.HTTPError as e:
        raise RuntimeError(f"{base}{route}: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        try:
            why = r.json().get("message", r.text)
        except ValueError:
            why = r.text
        raise RuntimeError(f"{base}{route} answered {r.status_code}: {why[:300]}")
    return r.json()


def _latencies(records: list[dict]) -> dict:
    ttft = [r["ttft_ms"] for r in records if r["ttft_ms"] is not None]
    tpot = [r["tpot_ms"] for r in records if r["tpot_ms"] is not None]
    return {"ttft_p50_ms": statistics.median(ttft) if ttft else float("inf"),
            "tpot_ms": statistics.median(tpot) if tpot else 0.0}


# `ouro serve` through its own parser only, so a probe module that fails to import elsewhere in
# the CLI cannot stop this scenario
SERVE_MAIN = ("import argparse, sys; from ouro.cli import add_serve_parser; p = argparse.ArgumentParser(); "
              "add_serve_parser(p.add_subparsers()); a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))")


LOAD_SECONDS = 20.0   # a server slowed down by the very fault under study still gives a trace


def stream_completions(base: str, prompt_ids: list[list[int]], max_tokens: int,
                       seconds: float | None = None, headers: dict | None = None) -> list[dict]:
    """All prompts at once, streamed: per request the time to first token and per output token.
    After `seconds` the requests still running are cut off (their partial times are kept)."""
    import asyncio
    import httpx

    async def one(client, ids):
        body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
        t0, stamps = time.perf_counter(), []
        try:
            async with client.stream("POST", base + "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        stamps.append(time.perf_counter())
        except asyncio.CancelledError:
            pass
        ttft = 1e3 * (stamps[0] - t0) if stamps else None
        tpot = 1e3 * (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
        return {"ttft_ms": ttft, "tpot_ms": tpot, "chunks": len(stamps)}

    async def run():
        async with httpx.AsyncClient(timeout=60, headers=headers) as client:
            tasks = [asyncio.ensure_future(one(client, ids)) for ids in prompt_ids]
            await asyncio.wait(tasks, timeout=seconds)
            for t in tasks:
                t.cancel()
            return await asyncio.gather(*tasks)
    return asyncio.run(run())
