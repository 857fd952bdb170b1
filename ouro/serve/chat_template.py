"""The checkpoint's own chat template, rendered as transformers' `apply_chat_template` does.

Template source, first found: `chat_template.jinja` in the checkpoint, `chat_template.json`
(`{"chat_template": ...}`), `tokenizer_config.json`'s `chat_template` (a string, or a list of
named templates: "tool_use" when tools are given and it exists, else "default").

The jinja environment is transformers': sandboxed and immutable, `trim_blocks`/`lstrip_blocks`,
loop controls, a `{% generation %}` block (rendered as its body), `raise_exception`,
`strftime_now`, a `tojson` filter that does not HTML-escape (`ensure_ascii`, `indent`,
`separators`, `sort_keys`), and the tokenizer's named special tokens (`eos_token`, ...) as
variables. Messages are normalised first (OpenAI forms -> what GLM-style templates read):

- roles system / developer (rendered as system) / user / assistant / tool; anything else is a
  ValueError naming the message;
- content: a string, None/missing, or a list of parts; a list of only text parts becomes one
  string, other lists are passed through (templates skip non-text parts);
- assistant `tool_calls`: `function.arguments` given as a JSON string is parsed into the object
  templates iterate over (it must be a JSON object); keys with None values are dropped, as
  transformers does; `reasoning` / `thinking` alias `reasoning_content`.

Template kwargs (the request's `chat_template_kwargs`, plus its top-level `reasoning_effort`)
pass through. Thinking switches are aliased both ways, so a template that reads only one of
them still obeys the other (vLLM #54744): `enable_thinking: false` adds
`reasoning_effort: "none"` and `reasoning_effort: "none"` adds `enable_thinking: false`, unless
the request set that kwarg itself. Template errors come out as ValueError.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROLES = ("system", "developer", "user", "assistant", "tool")
TEMPLATE_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt")   # render() sets these; kwargs may not
_NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): just the body."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    def __setitem__(self, name, value):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")
        super().__setitem__(name, value)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, namespace=_Namespace,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=lambda *a, **kw: dict(*a, **kw))
    return env.from_string(source)


def _plain(obj):
    dump = getattr(obj, "model_dump", None)      # pydantic request objects
    return dump() if callable(dump) else obj


def _no_none(d: Mapping) -> dict:
    return {k: v for k, v in d.items() if v is not None}


def _content(content, where: str):
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        raise ValueError(f"{where}.content must be a string, null or a list of parts")
    parts = [_plain(p) for p in content]
    for j, p in enumerate(parts):
        if not isinstance(p, Mapping) or "type" not in p:
            raise ValueError(f"{where}.content[{j}] must be an object with a 'type'")
        if p["type"] == "text" and not isinstance(p.get("text"), str):
            raise ValueError(f"{where}.content[{j}] is a text part without a string 'text'")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return [_no_none(p) for p in parts]


def _tool_call(tc, where: str) -> dict:
    tc = _plain(tc)
    if not isinstance(tc, Mapping) or not isinstance(_plain(tc.get("function")), Mapping):
        raise ValueError(f"{where} must be an object with a 'function'")
    fn = dict(_plain(tc["function"]))
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"{where}.function.name must be a non-empty string")
    args = fn.get("arguments")
    if args is None or (isinstance(args, str) and not args.strip()):
        args = {}
    elif isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError as e:
            raise ValueError(f"{where}.function.arguments is not valid JSON: {e}") from None
    if not isinstance(args, Mapping):
        raise ValueError(f"{where}.function.arguments must be a JSON object")
    return _no_none({**tc, "type": tc.get("type") or "function", "function": {**fn, "arguments": dict(args)}})


def normalize_messages(messages) -> list[dict]:
    """OpenAI chat messages (dicts or pydantic models) -> plain dicts templates can read."""
    out = []
    for i, m in enumerate(messages):
        m, where = _plain(m), f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise ValueError(f"{where} must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"{where} has unsupported role {role!r}; expected one of {', '.join(ROLES)}")
        msg = _no_none(m)
        msg["role"] = "system" if role == "developer" else role
        if "content" in msg:
            msg["content"] = _content(msg["content"], where)
        reasoning = next((m.get(k) for k in ("reasoning_content", "reasoning", "thinking") if m.get(k) is not None),
                         None)
        if reasoning is not None:
            msg["reasoning_content"] = msg["thinking"] = reasoning
        if msg.get("tool_calls"):
            if role != "assistant":
                raise ValueError(f"{where}: only assistant messages carry tool_calls")
            msg["tool_calls"] = [_tool_call(tc, f"{where}.tool_calls[{j}]") for j, tc in enumerate(msg["tool_calls"])]
        out.append(_no_none(msg))
    return out


def thinking_kwargs(kwargs: Mapping) -> dict:
    """Drop None kwargs and alias `enable_thinking: false` <-> `reasoning_effort: "none"`."""
    kw = _no_none(kwargs)
    if kw.get("enable_thinking") is False and "reasoning_effort" not in kw:
        kw["reasoning_effort"] = "none"
    effort = kw.get("reasoning_effort")
    if isinstance(effort, str) and effort.lower() == "none" and "enable_thinking" not in kw:
        kw["enable_thinking"] = False
    return kw


class ChatTemplate:
    def __init__(self, source: str | Mapping[str, str], special_tokens: Mapping[str, str] | None = None):
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_checkpoint(cls, directory) -> "ChatTemplate | None":
        """The checkpoint's template, or None when it has none."""
        d = Path(directory)
        config = _read_json(d / "tokenizer_config.json")
        special = {k: _token_text(config.get(k)) for k in _NAMED_TOKENS if _token_text(config.get(k))}
        if (d / "chat_template.jinja").is_file():
            source = (d / "chat_template.jinja").read_text(encoding="utf-8")
        else:
            source = _read_json(d / "chat_template.json").get("chat_template") or config.get("chat_template")
        if isinstance(source, list):
            source = {t["name"]: t["template"] for t in source}
        return cls(source, special) if source else None

    def _source(self, tools) -> str:
        if isinstance(self.source, str):
            return self.source
        if tools and "tool_use" in self.source:
            return self.source["tool_use"]
        if "default" in self.source:
            return self.source["default"]
        raise ValueError(f"the checkpoint has named chat templates {sorted(self.source)} but no 'default'")

    def render(self, messages, tools=None, add_generation_prompt: bool = True, **template_kwargs) -> str:
        """The prompt text (special tokens as text: encode it with the checkpoint's tokenizer)."""
        msgs = normalize_messages(messages)
        tool_list = [t.model_dump(exclude_none=True) if hasattr(t, "model_dump") else t for t in tools] if tools \
            else None
        context = {**self.special_tokens, **thinking_kwargs(template_kwargs)}
        try:
            return _compile(self._source(tool_list)).render(
                messages=msgs, tools=tool_list, documents=None, add_generation_prompt=add_generation_prompt,
                **context)
        except (jinja2.exceptions.TemplateError, TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"chat template error: {e}") from None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _token_text(tok) -> str | None:
    if isinstance(tok, Mapping):
        tok = tok.get("content")
    return tok if isinstance(tok, str) else None
