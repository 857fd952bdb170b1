"""Schemathesis hooks of the schema test (`SCHEMATHESIS_HOOKS=tests.helpers.schemathesis_hooks`): a request the
schema calls valid is kept quick to serve (max_tokens, n) and within the rules the schema can only
annotate or describe (protocol.py: a prompt's tokens plus max_tokens within the context, a named
tool_choice naming one of the tools, a forced tool call's tag within max_tokens, a grammar that
compiles, a past tool call's string arguments being what contentMediaType/contentSchema declare),
and a number schemathesis 4 draws just
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
    """What contentMediaType/contentSchema declare of a past tool call's string arguments (JSON
    text of an object, or blank): schemathesis 4 does not assert content keywords in every phase,
    so a string its pattern-driven phases draw is kept to what the schema declares."""
    try:
        return not v.strip() or isinstance(json.loads(v), dict)
    except ValueError:
        return False


# structured outputs: a schema-valid grammar string need not compile (the schema cannot say so; that at
# most one constraint is given, it says): each one present is made something that compiles
COMPILABLE = {"guided_json": {"type": "object"}, "json_schema": '{"type": "object"}', "guided_regex": "[a-z]{1,3}",
              "regex": "[a-z]{1,3}", "guided_grammar": 'root ::= "a"', "ebnf": 'root ::= "a"',
              "guided_choice": ["a", "b"]}
OUTPUTS = {"json": {"type": "object"}, "regex": "[a-z]{1,3}", "grammar": 'root ::= "a"', "choice": ["a", "b"]}


def _compilable(body) -> None:
    rf = body.get("response_format")
    if isinstance(rf, dict) and isinstance(rf.get("json_schema"), dict):
        rf["json_schema"]["schema"] = {"type": "object"}
    so = body.get("structured_outputs")
    if isinstance(so, dict):
        for key in OUTPUTS:
            if so.get(key) is not None:
                so[key] = OUTPUTS[key]
    for key, value in COMPILABLE.items():
        if body.get(key) is not None:
            body[key] = value
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and isinstance(fmt.get("schema"), dict):
        fmt["schema"] = {"type": "object"}
    for tool in body.get("tools") or []:       # a strict tool's parameters are compiled: keep them simple
        fn = tool.get("function", tool)
        if fn.get("strict"):
            fn["parameters"] = {"type": "object"}


@schemathesis.hook
def map_case(context, case):
    body = case.body
    if case.meta is None or not case.meta.generation.mode.is_positive or not isinstance(body, dict):
        return case
    _compilable(body)
    if case.path == "/v1/responses":
        _responses(body)
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
    generates = case.path in ("/v1/completions", "/v1/chat/completions")   # no other body has max_tokens
    if generates and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = tokens
    for message in body.get("messages") or []:
        for call in message.get("tool_calls") or []:
            args = call["function"].get("arguments")
            if isinstance(args, str) and not _object_text(args):
                call["function"]["arguments"] = "{}"
    if _number(body.get("n")):
        body["n"] = min(int(body["n"]), MAX_N)
    if _number(body.get("seed")):
        body["seed"] = min(max(int(body["seed"]), SEED[0]), SEED[1])
    return case


def _responses(case_body):
    """/v1/responses: the same rules in its own shapes (flat tools, input items, max_output_tokens)."""
    body = case_body
    choice, tools = body.get("tool_choice"), body.get("tools")
    forced = choice == "required" or isinstance(choice, dict)
    tokens = MAX_TOKENS
    if isinstance(choice, dict) and tools:
        choice["name"] = tools[0]["name"]
        tokens += len(choice["name"].encode())
    if isinstance(body.get("max_output_tokens"), int) and not forced:
        body["max_output_tokens"] = min(body["max_output_tokens"], tokens)
    else:
        body["max_output_tokens"] = tokens
    for item in body.get("input") if isinstance(body.get("input"), list) else []:
        if item.get("type") == "function_call" and not _object_text(item.get("arguments", "{}")):
            item["arguments"] = "{}"
        if isinstance(item.get("content"), list):    # this model reads no images
            item["content"] = [p if p.get("type") != "input_image" else {"type": "input_text", "text": "x"}
                               for p in item["content"]]
    return case_body
