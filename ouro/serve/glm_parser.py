"""GLM reply parsing: reasoning, content and tool calls, whole or streamed, always equal.

One left-to-right scanner (`glm_scanner.Scanner`) reads a reply. The whole-text parse runs it over the
text once; the streaming parser runs the same scanner over the accumulated text, resuming where
it stopped, and sends the difference between consecutive snapshots. The scanner stops only in
front of a suffix that could still become a tag (`</thi`), so a snapshot never contains text
whose meaning a later delta could change; every snapshot is a prefix, field by field, of the
final parse. Hence, for any split of the text into deltas, the concatenated deltas equal
`parse_reply` exactly (reasoning, content, and each call's id, name and arguments). Cost: O(reply
length) per delta (string copies at C speed; ~35 us per delta at 160k characters).

Rules (the decisions are marked *):
- Parsing starts in reasoning mode iff the rendered prompt ends inside an open `<think>`
  (`starts_in_reasoning`), whatever template or kwarg (`reasoning_effort`, `enable_thinking`)
  produced it. In content mode, a `<think>` as the first non-space output (templates that leave
  opening the block to the model) starts a reasoning block too.
- Reasoning ends at the first `</think>`; everything before it, `<tool_call>` included, is
  reasoning text (vLLM #45915). * A stray `</think>` in content mode is dropped; any other tag
  outside a tool call is kept as text.
- * A reply that ends while still in reasoning mode: with finish_reason "stop" (EOS, stop token or
  stop string) the model skipped thinking and wrote its answer without `</think>` (SGLang
  #37645), so that text is ALSO parsed as content (tool calls included). It stays in
  `reasoning_content` as well, because streamed reasoning deltas cannot be taken back and the
  non-streamed result must equal the stream. With any other finish_reason ("length", "abort")
  the model was cut off mid-thought: reasoning only, content empty.
- Reasoning and content are stripped of surrounding whitespace (as GLM's template strips them
  when rendering history); the stream holds trailing whitespace back until text follows.
- Tool calls (only when the request has tools and tool_choice is not "none"; otherwise the text
  stays content): `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`,
  whitespace allowed around the pairs. Names and keys are stripped; values are typed by the
  tool's schema (`tool_args`): strings raw and exact. Text before, between and after calls is
  content. * A duplicate key keeps its first value; a key without a value is dropped; a missing
  `</arg_value>` is closed by `</tool_call>`; a call left open at the end of the reply is closed
  there (an open value ends at the end); a call with an empty name is not a call and its raw text
  is content. Ids are `id_prefix + str(index)`, deterministic.
- Streaming a call: the header (index, id, type, name) once the name is complete, then argument
  pieces: `{`, each pair once its value is closed, a string-typed value as it arrives (its JSON
  escape is a prefix of the final one), `}` when the call closes.
"""

from __future__ import annotations

from dataclasses import dataclass

from .glm_scanner import CALL, END_CALL, END_KEY, END_THINK, END_VALUE, KEY, THINK, VALUE, Scanner  # noqa: F401
from .tool_args import strict_tools, tool_parameters

ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")


def starts_in_reasoning(prompt: str) -> bool:
    """True when the prompt ends inside an open `<think>` block (no `</think>` or role tag after it)."""
    i = prompt.rfind(THINK)
    if i < 0:
        return False
    tail = prompt[i + len(THINK):]
    return END_THINK not in tail and not any(t in tail for t in ROLE_TOKENS)


@dataclass(frozen=True)
class ReplyFormat:
    """What one request's replies look like; build with `for_request`."""
    reasoning_first: bool
    tools: dict | None = None        # {tool: {param: schema}}; None: tool-call text is content
    id_prefix: str = "call_"
    strict: frozenset = frozenset()  # tools held to their schema by a grammar (`strict: true`)

    @classmethod
    def for_request(cls, prompt: str, tools=None, tool_choice=None, id_prefix: str = "call_") -> "ReplyFormat":
        enabled = bool(tools) and tool_choice != "none"
        return cls(starts_in_reasoning(prompt), tool_parameters(tools) if enabled else None, id_prefix,
                   strict_tools(tools) if enabled else frozenset())


@dataclass(frozen=True)
class ParsedReply:
    reasoning_content: str
    content: str
    tool_calls: tuple = ()           # OpenAI dicts: {"id", "type": "function", "function": {"name", "arguments"}}

    def message(self) -> dict:
        """The OpenAI assistant message (content null when only tool calls came back)."""
        msg = {"role": "assistant", "content": self.content if self.content or not self.tool_calls else None,
               "reasoning_content": self.reasoning_content or None}
        if self.tool_calls:
            msg["tool_calls"] = [dict(c, function=dict(c["function"])) for c in self.tool_calls]
        return msg


def _reply(snap) -> ParsedReply:
    reasoning, content, calls = snap
    return ParsedReply(reasoning, content, tuple(
        {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in calls))


def parse_reply(text: str, fmt: ReplyFormat, finish_reason: str | None = "stop") -> ParsedReply:
    """Whole-text parse of one reply; `finish_reason` is the engine's ("stop", "length", ...)."""
    scanner = Scanner(fmt, fmt.reasoning_first)
    scanner.run(text, 0, eof=True)
    scanner.end(text, finish_reason)
    return _reply(scanner.snapshot())


class GlmReplyParser:
    """One choice's parser. Stream with `feed(delta)` ... `finish(finish_reason)` (lists of
    OpenAI delta dicts), or parse whole with `parse_all(text, finish_reason)`; `result` then holds
    the `ParsedReply`, equal for both ways."""

    def __init__(self, fmt: ReplyFormat):
        self.fmt = fmt
        self.text = ""
        self.result: ParsedReply | None = None
        self.diverged = False            # a snapshot was not an extension of what was sent (a bug)
        self._scanner = Scanner(fmt, fmt.reasoning_first)
        self._pos = 0
        self._sent = ["", "", []]        # reasoning, content, [arguments per call]

    def feed(self, delta: str) -> list[dict]:
        if self.result is not None:
            raise RuntimeError("feed() after finish()")
        self.text += delta
        self._pos = self._scanner.run(self.text, self._pos, eof=False)
        return self._diff(self._scanner.snapshot())

    def finish(self, finish_reason: str | None) -> list[dict]:
        if self.result is not None:
            return []
        self._scanner.run(self.text, self._pos, eof=True)
        self._scanner.end(self.text, finish_reason)
        snap = self._scanner.snapshot()
        self.result = _reply(snap)
        return self._diff(snap)

    def parse_all(self, text: str, finish_reason: str | None) -> dict:
        """Non-streamed: the assistant message fields (role, content, reasoning_content, tool_calls)."""
        self.result = parse_reply(text, self.fmt, finish_reason)
        return self.result.message()

    def has_tool_calls(self) -> bool:
        return bool(self.result.tool_calls if self.result is not None else self._scanner.calls)

    def _extend(self, old: str, new: str) -> str:
        if new.startswith(old):
            return new[len(old):]
        self.diverged = True
        return ""

    def _diff(self, snap) -> list[dict]:
        reasoning, content, calls = snap
        out = []
        for k, key, new in ((0, "reasoning_content", reasoning), (1, "content", content)):
            piece = self._extend(self._sent[k], new)
            if piece:
                out.append({key: piece})
                self._sent[k] = new
        sent_args = self._sent[2]
        for index, (call_id, name, args) in enumerate(calls):
            if index == len(sent_args):
                out.append({"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                            "function": {"name": name, "arguments": ""}}]})
                sent_args.append("")
            piece = self._extend(sent_args[index], args)
            if piece:
                out.append({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
                sent_args[index] = args
        return out
