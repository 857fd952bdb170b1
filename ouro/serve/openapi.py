"""The published OpenAPI schema, made to say what this server does: FastAPI's generated schema
with the errors the server really returns (the OpenAI body, 400 not FastAPI's 422), the limits
that are this server's own written in (`protocol.bound`: vocabulary, context, model name), the
bearer key when `--api-key` is set, and no chat route when the checkpoint has no chat template
(every chat request would be refused). A test runs every schemathesis check against it."""

from __future__ import annotations

from .protocol import BOUND

ERROR_STATUSES = {"400": "Invalid request (JSON, types, ranges, unknown fields, prompt too long)",
                  "401": "Missing or wrong API key (--api-key)", "404": "Unknown model (NotFoundError)",
                  "413": "Request body too large",
                  "429": "Waiting queue full (--max-queued-requests)", "503": "Draining, or the engine is not running"}
ERROR_BODY = {"type": "object", "required": ["object", "message", "type", "code"], "properties": {
    "object": {"type": "string", "enum": ["error"]}, "message": {"type": "string"}, "type": {"type": "string"},
    "param": {"type": ["string", "null"]}, "code": {"type": "integer"}}}

# a generation route's 200: JSON, or with "stream": true server-sent events (JSON chunks, then [DONE])
STREAMED = {200: {"description": 'The completion (JSON), or with "stream": true its chunks as server-sent events',
                  "content": {"text/event-stream": {"schema": {"type": "object", "required": ["data"], "properties": {
                      "data": {"anyOf": [{"const": "[DONE]"}, {"type": "string", "contentMediaType": "application/json",
                                                               "contentSchema": {"type": "object"}}]}}}}}}}


def openapi(app, state) -> dict:
    if app.openapi_schema:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi
    spec = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    schemas = spec.setdefault("components", {}).setdefault("schemas", {})
    schemas["ErrorBody"] = ERROR_BODY
    for schema in ("HTTPValidationError", "ValidationError"):
        schemas.pop(schema, None)
    if state.chat is None:
        spec["paths"].pop("/v1/chat/completions", None)
        schemas.pop("ChatCompletionRequest", None)
    if state.api_key is not None:
        spec["components"]["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
    ref = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}}
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            codes = ["401"] if path != "/health" else ["503"]
            if method == "post":
                codes = list(ERROR_STATUSES)
            for code in codes:
                responses[code] = {"description": ERROR_STATUSES[code], **ref}
            if state.api_key is not None and path != "/health":
                op["security"] = [{"apiKey": []}]
    _write_bounds(spec, state)
    app.openapi_schema = spec
    return spec


def _write_bounds(node, state) -> None:
    """Fill in every `protocol.bound(kind)` mark with this server's number."""
    limit = min(state.max_model_len, state.capacity_tokens)   # a prompt plus its completion fit in both
    values = {"token_id": ("maximum", state.vocab_size - 1), "prompt_tokens": ("maxItems", limit - 1),
              "max_tokens": ("maximum", limit - 1), "model": ("enum", [state.model_name])}
    if isinstance(node, list):
        for item in node:
            _write_bounds(item, state)
    if not isinstance(node, dict):
        return
    kind = node.pop(BOUND, None)
    if kind is not None:
        key, value = values[kind]
        for target in [b for b in node.get("anyOf", [node]) if b.get("type") != "null"]:
            target[key] = value
    for child in node.values():
        _write_bounds(child, state)
