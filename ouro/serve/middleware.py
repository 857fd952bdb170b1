"""What every request passes before its route, as pure ASGI middleware (streaming and disconnects
pass straight through):

- `Guard`: the API key, then for generation routes the overload and body-size limits, decided
  before the body is parsed; the body read with a cap and replayed; the request's in-flight place
  (`Place`), given back exactly once.
- `Methods`: HTTP methods for every route in one place (RFC 9110): a method that a known path does
  not support gets 405 with an `Allow` header naming those it does, in the OpenAI error body; HEAD
  is answered as GET without the content (uvicorn drops it); OPTIONS gets 204 and `Allow`. Unknown
  paths go on to the router's 404."""

from __future__ import annotations

from fastapi.responses import JSONResponse, Response
from starlette.routing import Match

from .protocol import ServeError, error_body
from .routes import error
from .state import GENERATE_ROUTES


def routed_methods(routes, scope) -> set[str]:
    """The methods of every route whose path matches the request's."""
    methods = set()
    for route in routes:
        if getattr(route, "methods", None) and route.matches(scope)[0] != Match.NONE:
            methods |= route.methods
    return methods


class Methods:
    def __init__(self, app, routes):
        self.app, self.routes = app, routes   # the app's route list, read on every request

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        routed, method = routed_methods(self.routes, scope), scope["method"]
        if not routed or method in routed:
            return await self.app(scope, receive, send)
        if method == "HEAD" and "GET" in routed:
            return await self.app({**scope, "method": "GET"}, receive, send)
        allow = {"Allow": ", ".join(sorted(routed | {"OPTIONS"} | ({"HEAD"} if "GET" in routed else set())))}
        if method == "OPTIONS":
            return await Response(status_code=204, headers=allow)(scope, receive, send)
        message = f"{method} is not allowed on {scope['path']}; it takes {allow['Allow']}"
        return await JSONResponse(error_body(message, 405), status_code=405, headers=allow)(scope, receive, send)


class Place:
    """One request's places among the in-flight sequences (one until the handler knows its prompts x
    n, `hold`); released exactly once."""

    def __init__(self, state):
        self.state, self.owned, self.released, self.held = state, False, False, 1

    def hold(self, sequences: int) -> None:
        """The request's prompts x n choices, counted against --max-num-seqs + --max-queued-requests:
        a 400 where it alone is more than the server takes, a 429 where the others leave no room."""
        st = self.state
        limit = st.sequence_limit
        if sequences > limit:
            raise ServeError(400, f"this request asks for {sequences} sequences (prompts x n) and the server takes "
                                  f"{limit} at once (--max-num-seqs {st.max_num_seqs} + --max-queued-requests "
                                  f"{st.max_queued_requests}); split it")
        if st.in_flight - self.held + sequences > limit:
            raise ServeError(429, f"too many sequences in flight ({st.in_flight}) for this request's {sequences}; "
                                  f"the waiting queue is full (--max-queued-requests {st.max_queued_requests}); "
                                  "retry later")
        st.in_flight += sequences - self.held
        self.held = sequences

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.state.in_flight -= self.held


class Guard:
    """Pure ASGI middleware (so streaming and disconnects pass straight through): the API key,
    then for generation routes the overload limits and for every POST the body-size limit, decided
    before the body is parsed. A POST body is read here with a cap (Content-Length or chunked alike)
    and replayed."""

    def __init__(self, app, state):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        st, m = self.state, self.state.metrics
        path = scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        refuse = None
        generate = scope["method"] == "POST" and path in GENERATE_ROUTES
        length = headers.get("content-length")
        if st.api_key is not None and path != "/health" and headers.get("authorization", "") != f"Bearer {st.api_key}":
            refuse = (401, "invalid or missing API key: send 'Authorization: Bearer <key>'")
        elif generate and st.draining:
            refuse = (503, "the server is draining (shutting down); retry elsewhere")
        elif generate and not st.client.healthy:
            refuse = (503, st.client.dead_reason or "the engine is still loading; retry shortly")
        elif generate and st.in_flight >= st.sequence_limit:
            refuse = (429, f"too many sequences in flight ({st.in_flight}); the waiting queue is full "
                           f"(--max-queued-requests {st.max_queued_requests}); retry later")
        elif scope["method"] == "POST" and length is not None and (not length.isdigit() or
                                                                   int(length) > st.max_body_bytes):
            # every POST body is capped (/tokenize's work grows with its body as a generation's does)
            refuse = (413, f"request body over {st.max_body_bytes} bytes")
        if refuse is not None:
            m.reject(refuse[0])
            return await error(*refuse)(scope, receive, send)
        if scope["method"] != "POST":
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
        if not generate:
            return await self.app(scope, replay, send)
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
