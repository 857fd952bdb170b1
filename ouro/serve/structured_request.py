"""A request's structured-output fields -> the engine's `SamplingParams.structured`.

Accepted, at most one per request (two are a 400): OpenAI's `response_format` (`json_object`,
`json_schema` with its `schema`; `strict` or not, the output is held to it, as vLLM does),
vLLM's `structured_outputs` {json, regex, choice, grammar, json_object} and its older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, SGLang's `json_schema` /
`regex` / `ebnf`; and a `tool_choice` that forces a call (required, or a named function: its
opening tag is forced, so no other constraint can hold beside it), with `strict: true` tools: the call's tags, name and arguments held to GLM's tool-call
format and the tools' `parameters` (xgrammar's `glm_4_7` structural tag); one call, then the reply
ends, unless `parallel_tool_calls` is true. In a chat whose reply
opens with reasoning the grammar starts after `</think>`, so the reasoning stays free.

`check` builds the spec's grammar off the event loop before any engine work (`grammar_of`: no
vocabulary needed), so one that does not build is a 400 naming the problem; the engine compiles it,
once (and answers a 400 itself in the rare case where only the compile fails).
"""

from __future__ import annotations

import asyncio
import json

from .protocol import ServeError

END_THINK = "</think>"


def _fields(body) -> list[tuple[str, dict]]:
    out = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        out.append(("response_format", {"type": "json_object"}))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise ServeError(400, "response_format json_schema needs json_schema.schema")
        out.append(("response_format", {"type": "json_schema", "schema": rf.json_schema.schema_}))
    so = body.structured_outputs
    if so is not None:
        for key, spec in (("json_", lambda v: {"type": "json_schema", "schema": v}),
                          ("regex", lambda v: {"type": "regex", "regex": v}),
                          ("choice", lambda v: {"type": "choice", "choice": v}),
                          ("grammar", lambda v: {"type": "grammar", "grammar": v}),
                          ("json_object", lambda v: {"type": "json_object"} if v else None)):
            v = getattr(so, key)
            if v is not None and spec(v) is not None:
                out.append((f"structured_outputs.{key.rstrip('_')}", spec(v)))
    for name, spec in (("guided_json", lambda v: {"type": "json_schema", "schema": v}),
                       ("guided_regex", lambda v: {"type": "regex", "regex": v}),
                       ("guided_choice", lambda v: {"type": "choice", "choice": v}),
                       ("guided_grammar", lambda v: {"type": "grammar", "grammar": v}),
                       ("json_schema", lambda v: {"type": "json_schema", "schema": v}),
                       ("regex", lambda v: {"type": "regex", "regex": v}),
                       ("ebnf", lambda v: {"type": "grammar", "grammar": v})):
        v = getattr(body, name, None)
        if v is not None:
            out.append((name, spec(v)))
    return out


def spec_for(state, body, rendered=None) -> dict | None:
    """The request's `structured` spec, or None; `rendered` (chat): the rendered prompt, for
    strict tools and for where the grammar starts."""
    found = _fields(body)
    tools = getattr(body, "tools", None) or []
    choice = getattr(body, "tool_choice", None)
    forced = choice == "required" or (choice is not None and not isinstance(choice, str))
    if forced:     # a forced call's tag is forced (strict tools: and its arguments held to a grammar)
        strict = any(t.function.strict for t in tools)
        found.append(("tool_choice (forced)", _tool_tag(body, tools, choice, rendered) if strict else None))
    if len(found) > 1:
        raise ServeError(400, f"one structured-output constraint per request, got {', '.join(n for n, _ in found)}")
    if not found or found[0][1] is None:
        return None
    spec = found[0][1]
    if spec["type"] == "choice" and not spec["choice"]:
        raise ServeError(400, f"{found[0][0]} needs at least one choice")
    reasoning = rendered is not None and rendered.fmt.reasoning_first
    if reasoning and spec["type"] != "structural_tag":
        after = state.tokenizer.token_to_id(END_THINK)
        if after is not None:
            spec["after"] = after
    return spec


def _tool_tag(body, tools, choice, rendered) -> dict:
    import xgrammar as xg
    defs = [{"type": "function", "function": t.function.model_dump(exclude_none=True, by_alias=True)} for t in tools]
    tc = choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.function.name}}
    reasoning = "enabled" if rendered is not None and rendered.fmt.reasoning_first else "disabled"
    parallel = bool(getattr(body, "parallel_tool_calls", None))     # a forced call is one call unless asked
    tag = xg.get_model_structural_tag("glm_4_7", tools=defs, tool_choice=tc, reasoning=reasoning, max_whitespace_cnt=1,
                                      parallel_tool_calls=parallel)
    return {"type": "structural_tag", "tag": json.loads(tag.model_dump_json())}


async def check(spec: dict | None) -> None:
    if spec is None:
        return
    from ..engine.structured import grammar_of
    try:
        await asyncio.to_thread(grammar_of, spec)
    except ValueError as e:
        raise ServeError(400, str(e)) from None
