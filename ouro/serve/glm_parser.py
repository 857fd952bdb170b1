"""GLM reply parsing: reasoning, content and tool calls, whole or streamed, always equal.

One left-to-right scanner (`_Scanner`) reads a reply. The whole-text parse runs it over the
text once; the streaming parser runs the same scanner over the accumulated text, resuming where
it stopped, and sends the difference between consecutive snapshots. The scanner stops only in
front of a suffix that could still become a tag (`</thi`), so a snapshot never contains text
whose meaning a later delta could change; every snapshot is a prefix, field by field, of the
final parse. Hence, for any split of the text into deltas, the concatenated deltas equal
`parse_reply` exactly (reasoning, content, and each call's id, name and arguments).

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

from dataclasses import dataclass, field

from .tool_args import STRING, dumps, encode_value, tool_parameters, value_kind

THINK, END_THINK = "<think>", "</think>"
CALL, END_CALL = "<tool_call>", "</tool_call>"
KEY, END_KEY = "<arg_key>", "</arg_key>"
VALUE, END_VALUE = "<arg_value>", "</arg_value>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")
_MAX_TAG = max(len(t) for t in (THINK, END_THINK, CALL, END_CALL, KEY, END_KEY, VALUE, END_VALUE))

# scanner modes
_R, _C, _NAME, _KEY, _AFTER_KEY, _VALUE, _AFTER_VALUE = range(7)
_CALL_TAGS = {_NAME: (KEY, END_CALL), _KEY: (END_KEY, END_CALL), _AFTER_KEY: (VALUE, KEY, END_CALL),
              _VALUE: (END_VALUE, END_CALL), _AFTER_VALUE: (KEY, END_CALL)}


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

    @classmethod
    def for_request(cls, prompt: str, tools=None, tool_choice=None, id_prefix: str = "call_") -> "ReplyFormat":
        enabled = bool(tools) and tool_choice != "none"
        return cls(starts_in_reasoning(prompt), tool_parameters(tools) if enabled else None, id_prefix)


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


@dataclass
class _Call:
    start: int                       # offset of "<tool_call>" in the scanned text
    name_raw: str = ""
    name: str | None = None          # set when complete; "" makes it not a call
    index: int = -1
    pairs: list = field(default_factory=list)   # '"key": value' JSON pieces
    keys: set = field(default_factory=set)
    key_raw: str = ""
    key: str = ""
    value: str = ""
    kind: object = None
    skip: bool = False               # value of a duplicate key
    closed: bool = False


class _Scanner:
    def __init__(self, fmt: ReplyFormat, reasoning: bool, allow_think: bool = True):
        self.fmt = fmt
        self.mode = _R if reasoning else _C
        self.reasoning = ""
        self.content = ""
        self.calls: list[_Call] = []
        self.call: _Call | None = None
        self.started = False                      # content mode saw non-space text or a call
        self.think_allowed = allow_think and not reasoning

    def _tags(self) -> tuple:
        if self.mode == _R:
            return (END_THINK,)
        if self.mode == _C:
            tags = (END_THINK,) + ((CALL,) if self.fmt.tools is not None else ())
            return tags + ((THINK,) if self.think_allowed and not self.started else ())
        return _CALL_TAGS[self.mode]

    def run(self, text: str, pos: int, eof: bool) -> int:
        """Scan from `pos`; return where it stopped (before a possible partial tag unless `eof`)."""
        n = len(text)
        while pos < n:
            i = text.find("<", pos)
            if i < 0:
                self._text(text[pos:])
                return n
            if i > pos:
                self._text(text[pos:i])
            tags = self._tags()
            for tag in tags:
                if text.startswith(tag, i):
                    self._tag(tag, text, i + len(tag))
                    pos = i + len(tag)
                    break
            else:
                if not eof and n - i < _MAX_TAG and any(t.startswith(text[i:]) for t in tags):
                    return i
                self._text("<")
                pos = i + 1
        return pos

    def _text(self, s: str) -> None:
        m, c = self.mode, self.call
        if m == _R:
            self.reasoning += s
        elif m == _C:
            self.content += s
            self.started = self.started or not s.isspace()
        elif m == _NAME:
            c.name_raw += s
        elif m == _KEY:
            c.key_raw += s
        elif m == _VALUE:
            c.value += s
        # between key and value, and between pairs: junk is ignored

    def _tag(self, tag: str, text: str, end: int) -> None:
        m, c = self.mode, self.call
        if m == _R:                              # END_THINK
            self.mode, self.think_allowed = _C, False
        elif m == _C:
            self.think_allowed = False
            if tag == THINK:
                self.mode = _R
            elif tag == CALL:
                self.call, self.mode = _Call(start=end - len(CALL)), _NAME
        elif tag == END_CALL:
            if m == _NAME:
                self._name_done()
            elif m == _VALUE:
                self._pair_done()
            self._close(text, end)
        elif tag == KEY:
            if m == _NAME:
                self._name_done()
            c.key_raw, self.mode = "", _KEY
        elif tag == END_KEY:
            c.key, self.mode = c.key_raw.strip(), _AFTER_KEY
        elif tag == VALUE:
            c.value, c.skip, self.mode = "", c.key in c.keys or not c.name, _VALUE
            c.kind = value_kind(self.fmt.tools, c.name or "", c.key)
        elif tag == END_VALUE:
            self._pair_done()
            self.mode = _AFTER_VALUE

    def _name_done(self) -> None:
        c = self.call
        c.name = c.name_raw.strip()
        if c.name:
            c.index = len(self.calls)
            self.calls.append(c)

    def _pair_done(self) -> None:
        c = self.call
        if not c.skip:
            c.pairs.append(f"{dumps(c.key)}: {encode_value(c.value, c.kind)}")
            c.keys.add(c.key)

    def _close(self, text: str, end: int) -> None:
        c = self.call
        c.closed, self.call, self.mode, self.started = True, None, _C, True
        if not c.name:
            self.content += text[c.start:end]

    def end(self, text: str, finish_reason: str | None) -> None:
        """The reply is over: close what is open (see the module docstring)."""
        if self.mode == _R:
            if finish_reason == "stop":
                sub = _Scanner(self.fmt, reasoning=False, allow_think=False)
                sub.run(self.reasoning, 0, eof=True)
                sub.end(self.reasoning, finish_reason)
                self.content += sub.content
                self.calls = sub.calls
            return
        if self.mode == _NAME:
            self._name_done()
        elif self.mode == _VALUE:
            self._pair_done()
        if self.mode != _C:
            self._close(text, len(text))

    def _args(self, c: _Call) -> str:
        s = "{" + ", ".join(c.pairs)
        if c.closed:
            return s + "}"
        if c is self.call and self.mode == _VALUE and c.kind == STRING and not c.skip:
            s += (", " if c.pairs else "") + f"{dumps(c.key)}: " + dumps(c.value)[:-1]
        return s

    def snapshot(self) -> tuple[str, str, list[tuple[str, str, str]]]:
        calls = [(f"{self.fmt.id_prefix}{c.index}", c.name, self._args(c)) for c in self.calls]
        return self.reasoning.strip(), self.content.strip(), calls


def _reply(snap) -> ParsedReply:
    reasoning, content, calls = snap
    return ParsedReply(reasoning, content, tuple(
        {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in calls))


def parse_reply(text: str, fmt: ReplyFormat, finish_reason: str | None = "stop") -> ParsedReply:
    """Whole-text parse of one reply; `finish_reason` is the engine's ("stop", "length", ...)."""
    scanner = _Scanner(fmt, fmt.reasoning_first)
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
        self._scanner = _Scanner(fmt, fmt.reasoning_first)
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
