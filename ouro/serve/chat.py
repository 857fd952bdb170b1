"""Chat glue for the server: the checkpoint's chat template (`chat_template.py`) renders the
request, and per choice a GLM output parser (`glm_parser.py`) splits reasoning, content and
tool calls, streamed or whole."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Rendered:
    text: str
    reasoning_open: bool    # the prompt ends inside <think>: the reply starts as reasoning


class ChatFormat:
    def __init__(self, template):
        self.template = template

    @classmethod
    def from_checkpoint(cls, directory, tokenizer):
        try:
            from .chat_template import ChatTemplate
        except ImportError:   # TEMP until the template module lands
            return None
        template = ChatTemplate.from_checkpoint(directory)
        return None if template is None else cls(template)

    def render(self, body) -> Rendered:
        raise NotImplementedError

    def parser(self, body, rendered: Rendered):
        raise NotImplementedError
