"""Schemathesis hooks of the schema test (`SCHEMATHESIS_HOOKS=schemathesis_hooks`): a request the
schema calls valid is kept quick to serve (max_tokens, n) and within the rules the schema can only
annotate or describe (protocol.py: a prompt's tokens plus max_tokens within the context, a named
tool_choice naming one of the tools, a forced tool call's tag within max_tokens, a past tool
call's string arguments being the JSON text of an object), and a number schemathesis 4 draws just
past a bound beyond 2**53 (it reads the bound through a float) is put back. Invalid requests go
out exactly as drawn."""

import json

import schemathesis

MAX_TOKENS, MAX_N = 8, 2   # 8: also room for a forced tool-call tag
SEED = (-(1 << 63), (1 << 64) - 1)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _context(case) -> int:
    """The server's token limit, read from its schema (max_tokens' maximum is for a 1-token prompt)."""
    props = case.operation.schema.raw_schema["components"]["schemas"]["CompletionRequest"]["properties"]
    return next(s["maximum"] for s in props["max_tokens"]["anyOf"] if s.get("type") == "integer") + 1


def _object_text(v) -> bool:
    try:
        return not v.strip() or isinstance(json.loads(v), dict)
    except ValueError:
        return False


@schemathesis.hook
def map_case(context, case):
    body = case.body
    if case.meta is None or not case.meta.generation.mode.is_positive or not isinstance(body, dict):
        return case
    choice, tools, prompt = body.get("tool_choice"), body.get("tools"), body.get("prompt")
    forced = choice == "required" or isinstance(choice, dict)
    tokens = MAX_TOKENS
    if isinstance(choice, dict) and tools:   # name a tool the request has
        choice["function"]["name"] = tools[0]["function"]["name"]
        tokens += len(choice["function"]["name"].encode())   # room for the forced tag and name
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], str):
        longest = max(len(p) if isinstance(p, list) else len(prompt) for p in prompt)
        tokens = max(1, min(tokens, _context(case) - longest))
    for key in ("max_tokens", "max_completion_tokens"):
        if _number(body.get(key)):
            body[key] = tokens if forced else min(int(body[key]), tokens)
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = tokens
    if _number(body.get("n")):
        body["n"] = min(int(body["n"]), MAX_N)
    if _number(body.get("seed")):
        body["seed"] = min(max(int(body["seed"]), SEED[0]), SEED[1])
    for message in body.get("messages") or []:
        for call in message.get("tool_calls") or []:
            args = call["function"].get("arguments")
            if isinstance(args, str) and not _object_text(args):
                call["function"]["arguments"] = "{}"
    return case
