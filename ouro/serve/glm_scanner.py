"""The GLM reply scanner behind `glm_parser` (read that module's docstring for the rules).

A left-to-right state machine over a reply's text: `run(text, pos, eof)` consumes from `pos`
and stops, unless `eof`, in front of a suffix that could still become a tag; `end()` closes what
is open once the reply is over; `snapshot()` gives (reasoning, content, [(id, name, arguments)])
where every field of a mid-reply snapshot is a prefix of the same field at the end."""

from __future__ import annotations

from dataclasses import dataclass, field

from .tool_args import STRING, dumps, encode_value, trim_formatting, value_kind

THINK, END_THINK = "<think>", "</think>"
CALL, END_CALL = "<tool_call>", "</tool_call>"
KEY, END_KEY = "<arg_key>", "</arg_key>"
VALUE, END_VALUE = "<arg_value>", "</arg_value>"
_MAX_TAG = max(len(t) for t in (THINK, END_THINK, CALL, END_CALL, KEY, END_KEY, VALUE, END_VALUE))

# scanner modes
_R, _C, _NAME, _KEY, _AFTER_KEY, _VALUE, _AFTER_VALUE = range(7)
_CALL_TAGS = {_NAME: (KEY, END_CALL), _KEY: (END_KEY, END_CALL), _AFTER_KEY: (VALUE, KEY, END_CALL),
              _VALUE: (END_VALUE, END_CALL), _AFTER_VALUE: (KEY, END_CALL)}


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
    value_json: str = ""             # JSON escape of `value` (string kind), kept as it grows
    kind: object = None
    skip: bool = False               # value of a duplicate key
    trim: bool = False               # a strict call's string value (`tool_args.trim_formatting`)
    closed: bool = False


class Scanner:
    def __init__(self, fmt, reasoning: bool, allow_think: bool = True):
        """`fmt`: a `glm_parser.ReplyFormat` (uses its `tools` and `id_prefix`)."""
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
            if c.trim:                       # a strict call: the grammar's formatting blanks are not value
                c.value_json = dumps(trim_formatting(c.value))[1:-1]
            elif c.kind == STRING:           # JSON escapes char by char: extend, don't redo
                c.value_json += dumps(s)[1:-1]
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
            c.value, c.value_json, c.skip, self.mode = "", "", c.key in c.keys or not c.name, _VALUE
            c.kind = value_kind(self.fmt.tools, c.name or "", c.key)
            c.trim = c.kind == STRING and c.name in self.fmt.strict
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
            value = dumps(trim_formatting(c.value)) if c.trim else encode_value(c.value, c.kind)
            c.pairs.append(f"{dumps(c.key)}: {value}")
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
                sub = Scanner(self.fmt, reasoning=False, allow_think=False)
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
            s += (", " if c.pairs else "") + f'{dumps(c.key)}: "' + c.value_json
        return s

    def snapshot(self) -> tuple[str, str, list[tuple[str, str, str]]]:
        calls = [(f"{self.fmt.id_prefix}{c.index}", c.name, self._args(c)) for c in self.calls]
        return self.reasoning.strip(), self.content.strip(), calls
