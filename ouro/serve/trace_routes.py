"""Tracing a running server on demand (as SGLang's /start_profile and /stop_profile):

    POST /start_trace   body optional: {"heartbeat": true}
    POST /stop_trace    -> the merged Chrome trace of the frontend and the engine process

/start_trace clears earlier events and turns the span tracer on here and in the engine process
(and the heartbeat thread in both when asked); /stop_trace turns it off and returns one trace
(open it in https://ui.perfetto.dev, or `ouro probe timeline --from-trace FILE`). Requests in
flight carry on: the engine switches between two steps. Bounded by the tracer's event cap
(`spans.MAX_EVENTS` per process, oldest dropped, counted in each process's `ouro_trace` event)
and the heartbeat's sample cap. The API key guards these routes like every other. A server
started with `--trace FILE` already records into its file: on-demand tracing is then refused.
The routes stay out of the OpenAPI schema: they are a diagnostic, not part of the OpenAI API."""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..measure import heartbeat, spans
from ..measure.chrome_trace import combine
from .engine_client import EngineUnavailable
from .protocol import ServeError, error_body

MAX_OPTIONS_BYTES = 4096


def conflict(message: str) -> JSONResponse:
    return JSONResponse(error_body(message, 409, "ConflictError"), status_code=409)


async def _options(request: Request) -> dict:
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > MAX_OPTIONS_BYTES):
        raise ServeError(413, f"/start_trace takes a small JSON body (at most {MAX_OPTIONS_BYTES} bytes)")
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        opts = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ServeError(400, f"invalid JSON body: {e}") from None
    if not isinstance(opts, dict) or set(opts) - {"heartbeat"} or not isinstance(opts.get("heartbeat", False), bool):
        raise ServeError(400, 'the body is optional; if sent, it is {"heartbeat": true|false}')
    return opts


def _stop_here() -> list[dict]:
    """The frontend's own events; recording stops and the memory is freed."""
    heartbeat.stop()
    spans.disable()
    events = spans.chrome_events(process_name="ouro frontend")
    spans.clear()
    heartbeat.clear()
    return events


def add_trace_routes(app, state) -> None:
    @app.post("/start_trace", include_in_schema=False)
    async def start_trace(request: Request):
        opts = await _options(request)
        if state.tracing is not None:
            return conflict("a trace is already being recorded; POST /stop_trace first")
        if spans.enabled():
            return conflict("this server records its trace into a file (--trace or OURO_TRACE); "
                            "on-demand tracing is off")
        if not state.client.healthy:
            raise ServeError(503, state.client.dead_reason or "the engine is still loading; retry shortly")
        beat = opts.get("heartbeat", False)
        state.tracing = {"heartbeat": beat, "since": time.time()}   # before any await: one trace at a time
        spans.clear()
        heartbeat.clear()
        spans.enable()
        if beat:
            heartbeat.start()
        try:
            await state.client.start_trace(beat)
        except EngineUnavailable as e:
            state.tracing = None
            _stop_here()
            raise ServeError(503, str(e)) from None
        return {"status": "tracing", "heartbeat": beat, "max_events": spans.MAX_EVENTS}

    @app.post("/stop_trace", include_in_schema=False)
    async def stop_trace():
        if state.tracing is None:
            return conflict("no trace is being recorded; POST /start_trace first")
        since, state.tracing = state.tracing["since"], None
        frontend = _stop_here()
        other = {"started": since, "seconds": round(time.time() - since, 3)}
        try:
            engine = await state.client.stop_trace()
        except EngineUnavailable as e:   # the frontend's half still says what happened
            engine, other["engine_error"] = [], str(e)
        doc = {**combine([frontend, engine]), "otherData": other}
        # the encoding of a large trace runs beside the event loop, which keeps streaming
        body = await asyncio.to_thread(json.dumps, doc)
        return Response(body, media_type="application/json")
