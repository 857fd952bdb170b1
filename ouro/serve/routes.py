"""The server's routes as plain functions on one router (`router`, included by
`api_server.build_app`): the OpenAI generation routes (`/v1/completions`, `/v1/chat/completions`,
`/v1/responses`) and `/health`, `/metrics`, `/v1/models`. Each reads the server's state
(`state.ServerState`) from `request.app.state.ouro`; the request's place among those in flight
(`request.state.place`) was taken by the middleware (`api_server.Guard`)."""

from __future__ import annotations

import asyncio
import json
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from ..measure import spans
from . import request_jobs, structured_request
from .generation import Generation
from .openapi import STREAMED
from .protocol import ChatCompletionRequest, CompletionRequest, ServeError, check_model, error_body
from .response_view import ResponseView
from .responses import ResponsesRequest, to_chat, to_response
from .responses_stream import sse_events
from .state import ServerState

router = APIRouter()


def error(status: int, message: str) -> JSONResponse:
    """An error answer: the status and the OpenAI error body."""
    return JSONResponse(error_body(message, status), status_code=status)


@router.get("/health")
async def health(request: Request):
    state = request.app.state.ouro
    if state.draining:
        return error(503, "draining")
    if not state.client.healthy:
        return error(503, state.client.dead_reason or "starting")
    return JSONResponse({"status": "ok"})


@router.get("/metrics", response_class=PlainTextResponse,
            responses={200: {"description": "Prometheus text exposition format 0.0.4"}})
async def metrics(request: Request):
    state = request.app.state.ouro
    m = state.metrics
    m.in_flight.set(state.in_flight)
    m.engine_up.set(1 if state.client.healthy else 0)
    return Response(m.render(), media_type="text/plain; version=0.0.4")


@router.get("/v1/models")
async def models(request: Request):
    state = request.app.state.ouro
    return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                        "owned_by": "ouro", "max_model_len": state.max_model_len}]}


@router.post("/v1/completions", response_model=None, responses=STREAMED)
async def completions(request: Request, body: CompletionRequest):
    return await _serve(request, body, chat=False)


@router.post("/v1/chat/completions", response_model=None, responses=STREAMED)
async def chat_completions(request: Request, body: ChatCompletionRequest):
    return await _serve(request, body, chat=True)


@router.post("/v1/responses", response_model=None, responses=STREAMED)
async def responses(request: Request, body: ResponsesRequest):
    state = request.app.state.ouro
    out = await _serve(request, to_chat(body), chat=True)
    if not body.stream:
        return JSONResponse(to_response(body, json.loads(out.body)))
    return StreamingResponse(sse_events(body, out.body_iterator, state.model_name), media_type="text/event-stream")


def _prepare(state, body, chat: bool) -> list:
    with spans.span("prepare", cat="request"):
        return request_jobs.chat_jobs(state, body) if chat else request_jobs.completion_jobs(state, body)


async def _serve(request: Request, body, chat: bool):
    """One generation request: prompts prepared and checked, the engine's generations started,
    then the whole answer or its SSE stream; every generation aborted however it ends."""
    state = request.app.state.ouro
    place = request.state.place
    place.trace_t0 = spans.now_ns()
    check_model(state, body.model)
    # template, tokenize, check: on a worker thread, so a long prompt's tokenization (seconds for a few
    # MB) holds no other request, nor /health, on the event loop
    jobs = await asyncio.to_thread(_prepare, state, body, chat)
    for j in jobs:
        _check_length(state, j.prompt_ids, body)
    place.hold(sum(len(j.child_params) for j in jobs))        # its sequences, not one place, count
    await structured_request.check(jobs[0].child_params[0].structured)     # a 400 if its grammar does not build
    gens = [Generation(state.client, state.metrics, state.tokenizer, j.prompt_ids, j.child_params, j.stop,
                       j.skip_special_tokens, images=j.images) for j in jobs]
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    place.owned = True
    try:
        for g in gens:
            await g.start()
    except BaseException as e:
        place.release()
        for g in gens:
            await g.abort()
        if isinstance(e, ServeError):
            raise ServeError(e.status, e.message) from None
        raise
    view = ResponseView(state, body, jobs, gens, rid, chat)
    if body.stream:
        return StreamingResponse(_stream(view, place), media_type="text/event-stream")
    try:
        await _collect_or_disconnect(request, gens)
    except ServeError as e:
        raise ServeError(e.status, e.message) from None
    finally:
        place.release()
        for g in gens:
            await g.abort()
        _trace_request(place)
    return JSONResponse(view.final())


async def _stream(view, place):
    try:
        for chunk in view.first_chunks():
            yield _sse(chunk)
        async for chunk in view.stream_chunks():
            yield _sse(chunk)
        yield "data: [DONE]\n\n"
    except ServeError as e:
        yield _sse({"object": "error", "message": e.message, "type": "ServiceUnavailableError"
                    if e.status == 503 else "BadRequestError", "code": e.status})
        yield "data: [DONE]\n\n"
    finally:   # client gone (cancelled), error or done: nothing may keep running in the engine
        place.release()
        for g in view.gens:
            await g.abort()
        _trace_request(place)


def _trace_request(place) -> None:
    """One HTTP request's lifetime, on its own lane: requests overlap on the one event loop."""
    spans.record("request", "request", place.trace_t0, spans.now_ns(), spans.lane("http requests"))


async def _collect_or_disconnect(request: Request, gens) -> None:
    """Run every generation to the end; abort them all if the client disconnects meanwhile."""
    async def run():
        for g in gens:
            async for _ in g.deltas():
                pass
    task = asyncio.ensure_future(run())
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if not done and await request.is_disconnected():
            task.cancel()
            for g in gens:
                await g.abort()
            raise ServeError(499, "client disconnected")
    task.result()


def _check_length(state: ServerState, ids: list[int], body) -> None:
    # both limits must fit when a chat request gives both (max_completion_tokens is the one used)
    want = max((w for w in (getattr(body, "max_completion_tokens", None), body.max_tokens) if w is not None),
               default=None)
    if not ids:
        raise ServeError(400, "the prompt is empty")
    bad = [t for t in ids if not 0 <= t < state.vocab_size]
    if bad:
        raise ServeError(400, f"prompt token ids out of range [0, {state.vocab_size}): {bad[:5]}")
    bad = [t for t in body.stop_token_ids or () if t >= state.vocab_size]
    if bad:
        raise ServeError(400, f"stop_token_ids out of range [0, {state.vocab_size}): {bad[:5]}")
    if want is not None and len(ids) + want > state.max_model_len:
        raise ServeError(400, f"This model's maximum context length is {state.max_model_len} tokens. However, you "
                            f"requested {len(ids) + want} tokens ({len(ids)} in the messages, {want} in the "
                            "completion). Please reduce the length of the messages or completion.")
    room = min(state.max_model_len, state.capacity_tokens)
    if len(ids) > room or (len(ids) == room and want != 0):     # max_tokens 0 scores a prompt of the full context
        raise ServeError(400, f"This model's maximum context length is {state.max_model_len} tokens "
                            f"(cache capacity {state.capacity_tokens} tokens). However, your prompt has {len(ids)} "
                            "tokens. Please reduce the length of the messages.")
    if want is not None and len(ids) + want > state.capacity_tokens:
        raise ServeError(400, f"prompt ({len(ids)} tokens) + max_tokens ({want}) exceeds the cache capacity "
                            f"{state.capacity_tokens} tokens; lower max_tokens")


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
