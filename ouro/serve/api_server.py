"""The HTTP frontend's application, assembled: the middleware every request passes (`middleware.py`:
the API key, overload and body-size limits before a body is read; HTTP methods), errors in the
OpenAI body, and the routes (`routes.py`: generation, /health,
/metrics, /v1/models; `tokenize_routes.py`; tracing on demand, `trace_routes.py`). Tokenisation,
chat templates and detokenisation happen in this process; the model runs in the engine process
(`engine_client.py`)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .middleware import Guard, Methods
from .openapi import openapi
from .protocol import ServeError
from .routes import error, router
from .state import ServerState
from .tokenize_routes import add_tokenize_routes
from .trace_routes import add_trace_routes


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
