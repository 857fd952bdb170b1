"""Typing GLM tool-call argument values by the tool's JSON schema.

GLM writes every argument value as text (`<arg_value>42</arg_value>`); OpenAI clients want
`arguments` as a JSON object. The declared schema decides the JSON type:

- a parameter whose schema allows `"string"` keeps its text exactly, whitespace and all (code),
  except in a strict tool's call, where the one blank each side its grammar allows is formatting;
- otherwise each declared type is tried in the fixed order null, boolean, integer, number,
  object, array on the stripped text (JSON syntax; booleans also as True/False); the first
  that parses wins; if none does, the value stays a string (the raw text);
- an unknown tool, an unknown parameter, or a schema that declares no usable type: the text is
  parsed as JSON if it is JSON, else kept as a string.

NaN and Infinity are never produced (they are not JSON). Used by `glm_parser`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

JSON_TYPES = ("null", "boolean", "integer", "number", "object", "array")
STRING = "string"  # kind of a value that is kept raw, so it can be streamed as it arrives


def _plain(obj):
    dump = getattr(obj, "model_dump", None)     # pydantic models (the server's protocol objects)
    return dump(exclude_none=True) if callable(dump) else obj


def tool_parameters(tools) -> dict[str, dict]:
    """OpenAI `tools` (dicts or pydantic models) -> {tool name: {parameter name: schema}}."""
    out: dict[str, dict] = {}
    for tool in tools or ():
        tool = _plain(tool)
        if not isinstance(tool, Mapping):
            continue
        fn = _plain(tool.get("function", tool))
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            continue
        params = _plain(fn.get("parameters")) or {}
        props = params.get("properties") if isinstance(params, Mapping) else None
        out.setdefault(fn["name"], dict(props) if isinstance(props, Mapping) else {})
    return out


def strict_tools(tools) -> frozenset:
    """Names of the tools with `strict: true`: their calls are held to a grammar (structured
    outputs) that allows one blank on each side of a value as formatting (`trim_formatting`)."""
    out = set()
    for tool in tools or ():
        fn = _plain(_plain(tool).get("function", tool)) if isinstance(_plain(tool), Mapping) else None
        if isinstance(fn, Mapping) and fn.get("strict") is True and isinstance(fn.get("name"), str):
            out.add(fn["name"])
    return frozenset(out)


def trim_formatting(raw: str) -> str:
    """A strict call's string value without the grammar's formatting blanks: the first character
    if blank, and the last if blank (while the value is open this holds a last blank back until
    more text follows it), so each open form is a prefix of the final one."""
    start = 1 if raw[:1].isspace() else 0
    end = len(raw) - (1 if len(raw) > start and raw[-1:].isspace() else 0)
    return raw[start:end]


def _schema_types(schema, depth: int = 0) -> set[str]:
    if not isinstance(schema, Mapping) or depth > 8:
        return set()
    t = schema.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    types: set[str] = set()
    for comb in ("anyOf", "oneOf", "allOf"):
        for sub in schema.get(comb) or ():
            types |= _schema_types(sub, depth + 1)
    if types:
        return types
    values = list(schema.get("enum") or ()) + ([schema["const"]] if "const" in schema else [])
    for v in values:
        types.add({str: STRING, bool: "boolean", int: "integer", float: "number", type(None): "null",
                   dict: "object", list: "array"}.get(type(v), STRING))
    if not types and "properties" in schema:
        types.add("object")
    if not types and "items" in schema:
        types.add("array")
    return types


def value_kind(params: Mapping[str, dict] | None, tool: str, key: str):
    """STRING (keep raw), a tuple of JSON types to try in order, or None (unknown: JSON if it is JSON)."""
    schema = (params or {}).get(tool, {}).get(key)
    types = _schema_types(schema)
    if STRING in types:
        return STRING
    ordered = tuple(t for t in JSON_TYPES if t in types)
    return ordered or None


def _reject_constant(name):
    raise ValueError(f"{name} is not JSON")


def _loads(text: str):
    return json.loads(text, parse_constant=_reject_constant)


def _coerce(text: str, kind: str):
    """(True, value) when `text` is a `kind`; (False, None) otherwise."""
    if kind == "boolean":
        low = text.lower()
        return (True, low == "true") if low in ("true", "false") else (False, None)
    try:
        value = _loads(text)
    except (ValueError, RecursionError):
        return False, None
    ok = {"null": value is None,
          "integer": isinstance(value, int) and not isinstance(value, bool),
          "number": isinstance(value, (int, float)) and not isinstance(value, bool),
          "object": isinstance(value, dict),
          "array": isinstance(value, list)}[kind]
    return (True, value) if ok else (False, None)


def dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def encode_value(raw: str, kind) -> str:
    """The JSON text of one argument value, typed by `kind` (from `value_kind`)."""
    if kind == STRING:
        return dumps(raw)
    if kind is None:
        try:
            return dumps(_loads(raw))
        except (ValueError, RecursionError):
            return dumps(raw)
    stripped = raw.strip()
    for t in kind:
        ok, value = _coerce(stripped, t)
        if ok:
            return dumps(value)
    return dumps(raw)
