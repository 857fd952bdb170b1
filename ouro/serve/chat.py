"""Chat glue for the server: the checkpoint's chat template (`chat_template.py`) renders the
request, and per choice a GLM reply parser (`glm_parser.py`) splits reasoning, content and tool
calls, streamed or whole. `tool_choice` "required" or a named function forces the reply to open
with a tool call (the GLM tags, and the name), as a prefix the engine samples first."""

from __future__ import annotations

from dataclasses import dataclass

from .chat_template import TEMPLATE_VARIABLES
from .glm_parser import CALL, END_THINK, GlmReplyParser, ReplyFormat


@dataclass
class Rendered:
    text: str
    fmt: ReplyFormat
    forced_prefix: str = ""   # text the reply must start with (tool_choice required / named)


class ChatFormat:
    def __init__(self, template):
        self.template = template

    @classmethod
    def from_checkpoint(cls, directory, tokenizer=None):
        from .chat_template import ChatTemplate
        template = ChatTemplate.from_checkpoint(directory)
        return None if template is None else cls(template)

    def render(self, body, messages=None) -> Rendered:
        """`messages`: the body's, as plain dicts, when the caller already read them (images)."""
        kwargs = dict(body.chat_template_kwargs or {})
        if body.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", body.reasoning_effort)
        if messages is None:
            messages = [m.model_dump(exclude_none=True) for m in body.messages]
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        choice = body.tool_choice
        if choice is not None and not isinstance(choice, str):
            choice = {"type": "function", "function": dict(choice.function)}
            name = choice["function"].get("name")
            if not tools or name not in [t["function"]["name"] for t in tools]:
                raise ValueError(f"tool_choice names the function {name!r}, which is not in tools")
        if choice in ("required",) and not tools:
            raise ValueError("tool_choice 'required' needs tools")
        clash = sorted(set(kwargs) & set(TEMPLATE_VARIABLES))
        if clash:
            raise ValueError(f"chat_template_kwargs cannot set {', '.join(clash)}: the request itself does")
        text = self.template.render(messages, tools, add_generation_prompt=body.add_generation_prompt, **kwargs)
        fmt = ReplyFormat.for_request(text, tools, choice if isinstance(choice, str) else "auto",
                                      id_prefix="call_")
        forced = ""
        if tools and (choice == "required" or isinstance(choice, dict)):
            forced = (END_THINK if fmt.reasoning_first else "") + CALL
            if isinstance(choice, dict):
                forced += choice["function"]["name"]
        return Rendered(text, fmt, forced)

    def parser(self, body, rendered: Rendered) -> GlmReplyParser:
        return GlmReplyParser(rendered.fmt)
