"""GLM reply parser: concrete parses, and streamed == whole at every split point."""

import json
import random

import pytest

from ouro.serve.glm_parser import GlmReplyParser, ReplyFormat, parse_reply, starts_in_reasoning

THINK_PROMPT = "[gMASK]<sop><|user|>\nhi<|assistant|>\n<think>"
PLAIN_PROMPT = "[gMASK]<sop><|user|>\nhi<|assistant|>\n<think></think>"

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "write_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "list_files", "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "set_alarm", "parameters": {"type": "object", "properties": {
        "hour": {"type": "integer"}, "enabled": {"type": "boolean"}, "meta": {"type": "object"},
        "tags": {"type": "array", "items": {"type": "string"}}, "ratio": {"type": "number"},
        "note": {"type": ["string", "null"]}, "nothing": {"type": "null"},
        "level": {"anyOf": [{"type": "integer"}, {"type": "null"}]}, "mode": {"enum": ["a", "b"]}}}}},
]

CODE = "def f(x):\n    if x < 3 and y </arg_va 2:\n        return '<tag>'  \n\t\treturn x\n\n"


def fmt(reasoning=True, tools=TOOLS, tool_choice=None):
    return ReplyFormat.for_request(THINK_PROMPT if reasoning else PLAIN_PROMPT, tools, tool_choice, "call_r1_")


def call(index, name, args):
    return {"id": f"call_r1_{index}", "type": "function", "function": {"name": name, "arguments": args}}


def wx(city, index=0):
    return call(index, "get_weather", json.dumps({"city": city}, ensure_ascii=False))


# (id, reasoning-first, tools on, text, finish_reason)
CORPUS = [
    ("think_then_answer", True, True, "Let me think.\n</think>\n\nThe answer is 4.", "stop"),
    ("no_end_think_stop", True, True, "The answer is 4, said without thinking.", "stop"),
    ("no_end_think_length", True, True, "Still thinking about </thi", "length"),
    ("no_end_think_tool", True, True, "Sure.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo"
                                      "</arg_value></tool_call>", "stop"),
    ("call_in_thinking", True, True, "I could <tool_call>get_weather<arg_key>city</arg_key><arg_value>X"
                                     "</arg_value></tool_call> it.</think>Ok.\n<tool_call>get_weather\n"
                                     "<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>", "stop"),
    ("zero_arg_calls", True, True, "</think><tool_call>list_files</tool_call>\n<tool_call>list_files\n"
                                   "</tool_call>", "stop"),
    ("code_value", True, True, "ok</think><tool_call>write_file\n<arg_key>path</arg_key>\n<arg_value> a b.py "
                               f"</arg_value>\n<arg_key>content</arg_key>\n<arg_value>{CODE}</arg_value>\n"
                               "</tool_call>", "stop"),
    ("non_ascii", True, True, "思考中🙂…</think>答案：東京 🗼 👨‍👩‍👧<tool_call>get_weather<arg_key>city"
                              "</arg_key><arg_value>東京🙂</arg_value></tool_call>", "stop"),
    ("typed_args", False, True, "<tool_call>set_alarm<arg_key>hour</arg_key><arg_value> 7 </arg_value>"
                                "<arg_key>enabled</arg_key><arg_value>true</arg_value><arg_key>meta</arg_key>"
                                '<arg_value>{"a": [1, 2], "b": "ü"}</arg_value><arg_key>tags</arg_key>'
                                '<arg_value>["x", "y"]</arg_value><arg_key>ratio</arg_key><arg_value>0.5'
                                "</arg_value><arg_key>note</arg_key><arg_value>null</arg_value>"
                                "<arg_key>nothing</arg_key><arg_value>null</arg_value><arg_key>level</arg_key>"
                                "<arg_value>3</arg_value><arg_key>mode</arg_key><arg_value>b</arg_value>"
                                "</tool_call>", "stop"),
    ("bad_typed_args", False, True, "<tool_call>set_alarm<arg_key>hour</arg_key><arg_value>seven</arg_value>"
                                    "<arg_key>enabled</arg_key><arg_value>yes</arg_value><arg_key>ratio"
                                    "</arg_key><arg_value>NaN</arg_value><arg_key>meta</arg_key>"
                                    "<arg_value>{oops</arg_value></tool_call>", "stop"),
    ("unknown_tool_and_args", False, True, "<tool_call>mystery<arg_key>n</arg_key><arg_value>42</arg_value>"
                                           "<arg_key>s</arg_key><arg_value>hello</arg_value><arg_key>o"
                                           '</arg_key><arg_value>{"k": 1}</arg_value></tool_call><tool_call>'
                                           "get_weather<arg_key>extra</arg_key><arg_value>true</arg_value>"
                                           "</tool_call>", "stop"),
    ("text_between_calls", True, True, "r</think>A <tool_call>get_weather<arg_key>city</arg_key><arg_value>"
                                       "Rome</arg_value></tool_call> B <tool_call>list_files</tool_call> C",
     "stop"),
    ("unclosed_call_value", True, True, "r</think>Sure.<tool_call>get_weather<arg_key>city</arg_key>"
                                        "<arg_value>Par", "length"),
    ("unclosed_call_name", False, True, "Text<tool_call>get_wea", "length"),
    ("unclosed_call_bare", False, True, "Text <tool_call>", "stop"),
    ("unclosed_after_value", False, True, "<tool_call>set_alarm<arg_key>hour</arg_key><arg_value>8</arg_value>",
     "stop"),
    ("stray_end_think", False, True, "Answer</think> more </think>", "stop"),
    ("empty_reasoning", True, True, "</think>Just the answer.", "stop"),
    ("blank_everything", True, True, "  \n</think>  \n ", "stop"),
    ("model_opens_think", False, True, "\n<think>reason <think> here</think>\nanswer <think>", "stop"),
    ("tools_off", True, False, "</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris"
                               "</arg_value></tool_call>", "stop"),
    ("malformed_pairs", False, True, "<tool_call>get_weather junk<arg_key>city</arg_key>x<arg_value>A"
                                     "</arg_value><arg_key>city</arg_key><arg_value>B</arg_value><arg_key>days"
                                     "</arg_key></tool_call><tool_call>get_weather<arg_key>city</arg_key>"
                                     "<arg_value>C</tool_call><tool_call>get_weather<arg_key>days</arg_key>"
                                     "<arg_key>city</arg_key><arg_value>D</arg_value></tool_call>", "stop"),
    ("empty_name_call", False, True, "<tool_call>\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>"
                                     "after", "stop"),
    ("literal_angles", False, True, "a < b, <tool <thin <tool_cal x <tool_ca", "stop"),
]
IDS = [c[0] for c in CORPUS]


def _format(case):
    _, reasoning, tools_on, _, _ = case
    return fmt(reasoning, TOOLS if tools_on else None)


def stream(f, pieces, finish_reason):
    """Feed pieces; check the delta shapes; return (reasoning, content, calls) as parse_reply would."""
    p = GlmReplyParser(f)
    deltas = [d for piece in pieces for d in p.feed(piece)] + p.finish(finish_reason)
    assert not p.diverged
    reasoning, content, calls = "", "", []
    for d in deltas:
        assert len(d) == 1 and all(v for v in d.values())
        if "reasoning_content" in d:
            reasoning += d["reasoning_content"]
        elif "content" in d:
            content += d["content"]
        else:
            (tc,) = d["tool_calls"]
            if tc["index"] == len(calls):           # header: id, type, name, empty arguments
                assert set(tc) == {"index", "id", "type", "function"} and tc["function"]["arguments"] == ""
                calls.append(call(tc["index"], tc["function"]["name"], ""))
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                calls[tc["index"]]["function"]["arguments"] += tc["function"]["arguments"]
                assert tc["index"] == len(calls) - 1     # arguments never go back to an earlier call
    assert p.result == parse_reply("".join(pieces), f, finish_reason)
    return reasoning, content, calls


def whole(case):
    r = parse_reply(case[3], _format(case), case[4])
    for c in r.tool_calls:
        assert isinstance(json.loads(c["function"]["arguments"]), dict)
    return r.reasoning_content, r.content, list(r.tool_calls)


@pytest.mark.parametrize("case", CORPUS, ids=IDS)
def test_every_two_way_split_equals_whole(case):
    text, want = case[3], whole(case)
    for i in range(len(text) + 1):
        assert stream(_format(case), [text[:i], text[i:]], case[4]) == want, f"split at {i}: {text[:i]!r}"


@pytest.mark.parametrize("case", CORPUS, ids=IDS)
def test_char_by_char_and_random_splits_equal_whole(case):
    text, want = case[3], whole(case)
    assert stream(_format(case), list(text), case[4]) == want
    rng = random.Random(case[0])
    for _ in range(25):
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(1, min(8, len(text)))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert stream(_format(case), pieces, case[4]) == want, pieces


def test_arguments_stream_before_the_call_closes():
    p = GlmReplyParser(fmt(False))
    out = p.feed("<tool_call>write_file<arg_key>content</arg_key><arg_value>line 1\n  line")
    args = "".join(tc["function"]["arguments"] for d in out for tc in d.get("tool_calls", []))
    assert args == '{"content": "line 1\\n  line'
    assert out[0]["tool_calls"][0]["function"]["name"] == "write_file"


# ---- concrete parses ----

def parsed(text, reasoning=True, tools=TOOLS, finish_reason="stop", tool_choice=None):
    return parse_reply(text, fmt(reasoning, tools, tool_choice), finish_reason)


def test_reasoning_split_and_strip():
    r = parsed("Let me think.\n</think>\n\nThe answer is 4.")
    assert (r.reasoning_content, r.content, r.tool_calls) == ("Let me think.", "The answer is 4.", ())
    assert r.message() == {"role": "assistant", "content": "The answer is 4.", "reasoning_content": "Let me think."}


def test_start_mode_comes_from_the_prompt():
    assert starts_in_reasoning(THINK_PROMPT) and starts_in_reasoning(THINK_PROMPT + "\n")
    assert not starts_in_reasoning(PLAIN_PROMPT)
    assert not starts_in_reasoning("<|user|>\nwhat is <think>?<|assistant|>\n")
    assert starts_in_reasoning("<|assistant|>\n<think>partial reasoning so far")
    assert parsed("Hi.", reasoning=False) == parsed("Hi.", reasoning=False, finish_reason="length")
    assert parsed("Hi.", reasoning=False).content == "Hi." and parsed("Hi.", reasoning=False).reasoning_content == ""


def test_reply_without_end_think():
    # finish "stop": the model skipped thinking; the text is the answer (and stays reasoning too)
    r = parsed("The answer is 4.")
    assert (r.reasoning_content, r.content) == ("The answer is 4.", "The answer is 4.")
    r = parsed("Sure.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_call>")
    assert r.content == "Sure." and r.tool_calls == (wx("Oslo"),)
    # cut off ("length") mid-thought: reasoning only
    r = parsed("Still thinking", finish_reason="length")
    assert (r.reasoning_content, r.content, r.tool_calls) == ("Still thinking", "", ())


def test_tool_call_inside_thinking_is_reasoning():
    r = whole(CORPUS[IDS.index("call_in_thinking")])
    assert r[0] == ("I could <tool_call>get_weather<arg_key>city</arg_key><arg_value>X</arg_value>"
                    "</tool_call> it.")
    assert r[1] == "Ok." and r[2] == [wx("Paris")]


def test_glm_newline_layout_zero_args_and_several_calls():
    r = whole(CORPUS[IDS.index("zero_arg_calls")])
    assert r == ("", "", [call(0, "list_files", "{}"), call(1, "list_files", "{}")])
    r = whole(CORPUS[IDS.index("text_between_calls")])
    assert r == ("r", "A  B  C", [wx("Rome"), call(1, "list_files", "{}")])


def test_string_values_are_exact():
    r = whole(CORPUS[IDS.index("code_value")])
    assert json.loads(r[2][0]["function"]["arguments"]) == {"path": " a b.py ", "content": CODE}
    r = whole(CORPUS[IDS.index("non_ascii")])
    assert r[:2] == ("思考中🙂…", "答案：東京 🗼 👨‍👩‍👧")
    assert r[2][0]["function"]["arguments"] == '{"city": "東京🙂"}'   # not \\u-escaped


def test_schema_typing():
    args = json.loads(whole(CORPUS[IDS.index("typed_args")])[2][0]["function"]["arguments"])
    assert args == {"hour": 7, "enabled": True, "meta": {"a": [1, 2], "b": "ü"}, "tags": ["x", "y"],
                    "ratio": 0.5, "note": "null", "nothing": None, "level": 3, "mode": "b"}
    assert type(args["hour"]) is int and type(args["ratio"]) is float
    bad = json.loads(whole(CORPUS[IDS.index("bad_typed_args")])[2][0]["function"]["arguments"])
    assert bad == {"hour": "seven", "enabled": "yes", "ratio": "NaN", "meta": "{oops"}
    unknown = whole(CORPUS[IDS.index("unknown_tool_and_args")])[2]
    assert json.loads(unknown[0]["function"]["arguments"]) == {"n": 42, "s": "hello", "o": {"k": 1}}
    assert unknown[1]["function"]["arguments"] == '{"extra": true}'
    r = parsed("</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>42</arg_value>"
               "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>")
    assert r.tool_calls[0]["function"]["arguments"] == '{"city": "42", "days": 2}'


def test_tools_off_or_tool_choice_none_leave_text():
    text = "</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"
    for r in (parsed(text, tools=None), parsed(text, tool_choice="none"), parsed(text, tools=[])):
        assert r.tool_calls == () and r.content == text[len("</think>"):]
    assert parsed(text, tool_choice="required").tool_calls == (wx("Paris"),)


def test_malformed_and_unclosed_calls():
    r = whole(CORPUS[IDS.index("malformed_pairs")])
    assert [c["function"]["arguments"] for c in r[2]] == ['{"city": "A"}', '{"city": "C"}', '{"city": "D"}']
    assert whole(CORPUS[IDS.index("unclosed_call_value")])[1:] == ("Sure.", [wx("Par")])
    assert whole(CORPUS[IDS.index("unclosed_call_name")])[1:] == ("Text", [call(0, "get_wea", "{}")])
    assert whole(CORPUS[IDS.index("unclosed_call_bare")])[1:] == ("Text <tool_call>", [])
    assert whole(CORPUS[IDS.index("unclosed_after_value")])[2] == [call(0, "set_alarm", '{"hour": 8}')]
    assert whole(CORPUS[IDS.index("empty_name_call")])[1:] == (
        "<tool_call>\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>after", [])


def test_think_tags_in_content_mode():
    assert whole(CORPUS[IDS.index("stray_end_think")])[:2] == ("", "Answer more")
    assert whole(CORPUS[IDS.index("model_opens_think")])[:2] == ("reason <think> here", "answer <think>")
    assert whole(CORPUS[IDS.index("blank_everything")])[:2] == ("", "")
    assert whole(CORPUS[IDS.index("literal_angles")])[1] == "a < b, <tool <thin <tool_cal x <tool_ca"


def test_ids_are_deterministic_and_prefixed():
    text = "</think><tool_call>list_files</tool_call><tool_call>get_weather<arg_key>city</arg_key>" \
           "<arg_value>Oslo</arg_value></tool_call>"
    a = parse_reply(text, ReplyFormat.for_request(THINK_PROMPT, TOOLS, "auto", "call_abc_"))
    b = parse_reply(text, ReplyFormat.for_request(THINK_PROMPT, TOOLS, "auto", "call_abc_"))
    assert a == b and [c["id"] for c in a.tool_calls] == ["call_abc_0", "call_abc_1"]
    assert a.message()["content"] is None and a.message()["tool_calls"][1]["function"]["name"] == "get_weather"


def test_parser_object_api():
    f = fmt()
    p = GlmReplyParser(f)
    msg = p.parse_all("x</think><tool_call>list_files</tool_call>", "stop")
    assert p.has_tool_calls() and msg["tool_calls"] == [call(0, "list_files", "{}")]
    s = GlmReplyParser(f)
    s.feed("x</think><tool_call>list_files")
    assert not s.has_tool_calls()          # the name may go on
    s.feed("<")
    assert not s.has_tool_calls()
    s.feed("/tool_call>")
    assert s.has_tool_calls()
    s.finish("stop")
    assert s.finish("stop") == [] and s.result.tool_calls == p.result.tool_calls
    with pytest.raises(RuntimeError):
        s.feed("more")
