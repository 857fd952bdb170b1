"""HTTP methods for every route in one place (RFC 9110), as pure ASGI middleware: a method that a
known path does not support gets 405 with an `Allow` header naming those it does, in the OpenAI
error body; HEAD is answered as GET without the content (uvicorn drops it); OPTIONS gets 204 and
`Allow`. Unknown paths go on to the router's 404."""

from __future__ import annotations

from fastapi.responses import JSONResponse, Response
from starlette.routing import Match

from .protocol import error_body


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
