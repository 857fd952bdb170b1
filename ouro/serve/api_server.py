"""The HTTP frontend's application: the API key, overload and body-size limits (`Guard`, before a
body is read), errors in the OpenAI body, and the routes (`routes.py`: generation, /health,
/metrics, /v1/models; `tokenize_routes.py`; tracing on demand, `trace_routes.py`). Tokenisation,
chat templates and detokenisation happen in this process; the model runs in the engine process
(`engine_client.py`)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .methods import Methods
from .openapi import openapi
from .protocol import ServeError
from .routes import error, router
from .state import GENERATE_ROUTES, ServerState
from .tokenize_routes import add_tokenize_routes
from .trace_routes import add_trace_routes


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


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="ouro", version="0.1.0", description="OpenAI-compatible server for glm5_next models")
    app.state.ouro = state
    m = state.metrics
    # the routes themselves, not `include_router`: FastAPI 0.165 mounts an included router as one
    # opaque route, and `Methods` reads each route's own methods for 405 and Allow
    app.router.routes.extend(router.routes)
    add_trace_routes(app, state)
    add_tokenize_routes(app, state)

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

    return app


def _describe(errors) -> str:
    parts = []
    for e in errors[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        if e.get("type") == "extra_forbidden":    # protocol.py's one rule for fields
            parts.append(f"{loc}: unknown field (ouro refuses fields it does not implement rather than ignore them)")
        else:
            parts.append(f"{loc or 'body'}: {e.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts)
