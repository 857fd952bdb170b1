"""The HTTP frontend: OpenAI routes, errors in the OpenAI body, API key, overload and body-size
limits, SSE streaming, /health and /metrics, tracing on demand (`trace_routes.py`). Tokenisation,
chat templates and detokenisation happen here; the model runs in the engine process
(`engine_client.py`)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..measure import spans
from . import request_jobs, structured_request
from .generation import Generation
from .methods import Methods
from .metrics import Metrics
from .openapi import STREAMED, openapi
from .protocol import ChatCompletionRequest, CompletionRequest, ServeError, error_body
from .response_view import ResponseView
from .responses import ResponsesRequest, sse_events, to_chat, to_response
from .tokenize_routes import add_tokenize_routes, check_model
from .trace_routes import add_trace_routes

if TYPE_CHECKING:     # the state's collaborators, named for readers and checkers (no import at run time)
    from tokenizers import Tokenizer

    from ..engine.multimodal import ImagePrompt
    from ..engine.structured import GrammarBook
    from .chat import ChatFormat
    from .engine_client import EngineClient
    from .media import MediaLimits

GENERATE_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


@dataclass
class ServerState:
    client: EngineClient
    tokenizer: Tokenizer
    chat: ChatFormat | None          # None without a chat template
    model_name: str
    max_model_len: int
    capacity_tokens: int
    vocab_size: int
    api_key: str | None = None
    max_queued_requests: int = 256
    max_num_seqs: int = 64
    max_body_bytes: int = 4 << 20
    draining: bool = False
    in_flight: int = 0
    tracing: dict | None = None      # an on-demand trace being recorded (trace_routes.py)
    images: ImagePrompt | None = None    # None: the model takes text only
    media: MediaLimits | None = None
    eos_token_ids: tuple = ()
    grammars: GrammarBook | None = None   # structured outputs checked here first
    tokenizer_info: dict = field(default_factory=dict)   # GET /tokenizer_info (tokenize_routes.tokenizer_info)
    metrics: Metrics = field(default=None)
    created: int = field(default_factory=lambda: int(time.time()))


class Place:
    """One request's place among the in-flight requests; released exactly once."""

    def __init__(self, state):
        self.state, self.owned, self.released = state, False, False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.state.in_flight -= 1


class Guard:
    """Pure ASGI middleware (so streaming and disconnects pass straight through): the API key,
    then for generation routes the overload and body-size limits, decided before the body is
    parsed. The body is read here with a cap (Content-Length or chunked alike) and replayed."""

    def __init__(self, app, state):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        st, m = self.state, self.state.metrics
        path = scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        refuse = None
        if st.api_key is not None and path != "/health" and headers.get("authorization", "") != f"Bearer {st.api_key}":
            refuse = (401, "invalid or missing API key: send 'Authorization: Bearer <key>'")
        elif scope["method"] == "POST" and path in GENERATE_ROUTES:
            length = headers.get("content-length")
            if st.draining:
                refuse = (503, "the server is draining (shutting down); retry elsewhere")
            elif not st.client.healthy:
                refuse = (503, st.client.dead_reason or "the engine is still loading; retry shortly")
            elif st.in_flight >= st.max_num_seqs + st.max_queued_requests:
                refuse = (429, f"too many requests in flight ({st.in_flight}); the waiting queue is full "
                               f"(--max-queued-requests {st.max_queued_requests}); retry later")
            elif length is not None and (not length.isdigit() or int(length) > st.max_body_bytes):
                refuse = (413, f"request body over {st.max_body_bytes} bytes")
        if refuse is not None:
            m.reject(refuse[0])
            return await error(*refuse)(scope, receive, send)
        if not (scope["method"] == "POST" and path in GENERATE_ROUTES):
            return await self.app(scope, receive, send)
        body, more = b"", True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
            if len(body) > st.max_body_bytes:
                m.reject(413)
                return await error(413, f"request body over {st.max_body_bytes} bytes")(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()
        # the request holds an in-flight place from here; the handler takes it over (and gives it
        # back when its response ends), or it is given back below if the handler never ran
        st.in_flight += 1
        place = Place(st)
        scope.setdefault("state", {})["place"] = place
        try:
            await self.app(scope, replay, send)
        finally:
            if not place.owned:
                place.release()


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(message, status), status_code=status)


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="ouro", version="0.1.0", description="OpenAI-compatible server for glm5_next models")
    app.state.ouro = state
    m = state.metrics

    app.add_middleware(Methods, routes=app.routes)   # inside the Guard: the API key comes first
    app.add_middleware(Guard, state=state)
    app.openapi = lambda: openapi(app, state)

    @app.exception_handler(ServeError)
    async def api_error(_, e: ServeError):
        m.reject(e.status)
        return error(e.status, e.message)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        m.reject(400)
        kind = request.headers.get("content-type", "")
        if "json" not in kind.lower():   # curl -d without -H sends form-encoded: never read as JSON (no CSRF)
            return error(400, "the body must be JSON sent with 'content-type: application/json' (got "
                              f"{repr(kind) if kind else 'no content-type'}; curl: add -H 'content-type: application/json')")
        return error(400, _describe(e.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, e: StarletteHTTPException):
        return error(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def internal_error(_, e: Exception):
        m.reject(500)
        return error(500, f"internal error: {type(e).__name__}: {e}")

    @app.get("/health")
    async def health():
        if state.draining:
            return error(503, "draining")
        if not state.client.healthy:
            return error(503, state.client.dead_reason or "starting")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text exposition format 0.0.4"}})
    async def metrics():
        m.in_flight.set(state.in_flight)
        m.engine_up.set(1 if state.client.healthy else 0)
        return Response(m.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "ouro", "max_model_len": state.max_model_len}]}

    add_trace_routes(app, state)
    add_tokenize_routes(app, state)

    @app.post("/v1/completions", response_model=None, responses=STREAMED)
    async def completions(request: Request, body: CompletionRequest):
        return await _serve(request, body, chat=False)

    @app.post("/v1/chat/completions", response_model=None, responses=STREAMED)
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        return await _serve(request, body, chat=True)

    @app.post("/v1/responses", response_model=None, responses=STREAMED)
    async def responses(request: Request, body: ResponsesRequest):
        out = await _serve(request, to_chat(body), chat=True)
        if not body.stream:
            return JSONResponse(to_response(body, json.loads(out.body)))
        return StreamingResponse(sse_events(body, out.body_iterator, state.model_name), media_type="text/event-stream")

    async def _serve(request: Request, body, chat: bool):
        place = request.state.place
        place.trace_t0 = spans.now_ns()
        check_model(state, body.model)
        with spans.span("prepare", cat="request"):   # template, tokenize, check
            jobs = request_jobs.chat_jobs(state, body) if chat else request_jobs.completion_jobs(state, body)
        for j in jobs:
            _check_length(state, j.prompt_ids, body)
        await structured_request.check(state, jobs[0].child_params[0].structured)     # a 400 if it does not compile
        gens = [Generation(state.client, m, state.tokenizer, j.prompt_ids, j.child_params, j.stop,
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

    return app


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
    if want is not None and len(ids) + want > state.max_model_len:
        raise ServeError(400, f"This model's maximum context length is {state.max_model_len} tokens. However, you "
                            f"requested {len(ids) + want} tokens ({len(ids)} in the messages, {want} in the "
                            "completion). Please reduce the length of the messages or completion.")
    if len(ids) >= min(state.max_model_len, state.capacity_tokens):
        raise ServeError(400, f"This model's maximum context length is {state.max_model_len} tokens "
                            f"(cache capacity {state.capacity_tokens} tokens). However, your prompt has {len(ids)} "
                            "tokens. Please reduce the length of the messages.")
    if want is not None and len(ids) + want > state.capacity_tokens:
        raise ServeError(400, f"prompt ({len(ids)} tokens) + max_tokens ({want}) exceeds the cache capacity "
                            f"{state.capacity_tokens} tokens; lower max_tokens")


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _describe(errors) -> str:
    parts = []
    for e in errors[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        if e.get("type") == "extra_forbidden":    # protocol.py's one rule for fields
            parts.append(f"{loc}: unknown field (ouro refuses fields it does not implement rather than ignore them)")
        else:
            parts.append(f"{loc or 'body'}: {e.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts)
