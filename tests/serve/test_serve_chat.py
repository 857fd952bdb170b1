"""Chat completions on a real server: GLM reasoning and tool calls, streamed and not, with
replies scripted through a logits processor (the model itself is random)."""

import json

import openai
import pytest

from tests.helpers.serve_helpers import Server

pytestmark = pytest.mark.processes

TOOL_REPLY = ("The user wants weather. <tool_call>not a call</tool_call></think>Let me check.<tool_call>get_weather\n"
              "<arg_key>city</arg_key>\n<arg_value>São Paulo</arg_value>\n<arg_key>days</arg_key>\n"
              "<arg_value>3</arg_value>\n<arg_key>code</arg_key>\n<arg_value>def f():\n    return 1\n</arg_value>\n"
              "</tool_call><tool_call>get_time\n</tool_call>")
SCRIPT = [
    {"trigger": "TOOLCALL", "reply": TOOL_REPLY},
    {"trigger": "REASON", "reply": "two plus two</think>The answer is 4."},
    {"trigger": "PLAIN", "reply": "A plain answer."},
    {"trigger": "NOCLOSE", "reply": "An answer without closing"},
]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string"}, "days": {"type": "integer"},
                                          "code": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    s = Server(tiny_checkpoint, script=SCRIPT, tmp_path=tmp_path_factory.mktemp("chat_logs"))
    yield s
    s.stop()


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)


def user(text):
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}]


def streamed(client, **kw):
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            d = ch.delta
            reasoning += getattr(d, "reasoning_content", None) or (d.model_extra or {}).get("reasoning_content") or ""
            content += d.content or ""
            for tc in d.tool_calls or []:
                c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                c["id"] = tc.id or c["id"]
                if tc.function is not None:
                    c["name"] += tc.function.name or ""
                    c["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    return reasoning, content, [calls[i] for i in sorted(calls)], finish


def reasoning_of(msg):
    return getattr(msg, "reasoning_content", None) or (msg.model_extra or {}).get("reasoning_content")


def test_reasoning_is_split_from_content(client):
    kw = dict(model=None, messages=user("REASON please"), max_tokens=40)
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert reasoning_of(msg) == "two plus two" and msg.content == "The answer is 4."
    assert r.choices[0].logprobs is None                      # not asked for
    assert r.choices[0].finish_reason == "stop"
    assert streamed(client, **kw)[:2] == ("two plus two", "The answer is 4.")


def test_tool_call_round_trip(client):
    kw = dict(model=None, messages=user("TOOLCALL now"), tools=TOOLS, max_tokens=200)
    r = client.chat.completions.create(**kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert "<tool_call>not a call</tool_call>" in reasoning_of(ch.message)   # inside thinking: text
    assert ch.message.content == "Let me check."
    calls = ch.message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].function.arguments) == {"city": "São Paulo", "days": 3, "code": "def f():\n    return 1\n"}
    assert json.loads(calls[1].function.arguments) == {}
    # the stream concatenates to exactly the same
    reasoning, content, scalls, finish = streamed(client, **kw)
    assert (reasoning, content, finish) == (reasoning_of(ch.message), ch.message.content, "tool_calls")
    assert [(c["id"], c["name"], c["arguments"]) for c in scalls] == [
        (c.id, c.function.name, c.function.arguments) for c in calls]
    # the tool results go back as observation turns and the conversation continues
    history = user("TOOLCALL now") + [
        {"role": "assistant", "content": ch.message.content, "tool_calls": [c.model_dump() for c in calls]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny, 25C"},
        {"role": "tool", "tool_call_id": calls[1].id, "content": "12:00"},
        {"role": "user", "content": "PLAIN summary"}]
    r2 = client.chat.completions.create(model=None, messages=history, tools=TOOLS, max_tokens=30)
    assert r2.choices[0].message.content == "A plain answer."
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens + 10


def test_tool_choice_none_leaves_tool_text_as_content(client):
    r = client.chat.completions.create(model=None, messages=user("TOOLCALL now"), tools=TOOLS, tool_choice="none",
                                       max_tokens=200)
    msg = r.choices[0].message
    assert not msg.tool_calls and "<tool_call>get_weather" in msg.content and r.choices[0].finish_reason == "stop"


def test_named_tool_choice_forces_that_call(client):
    r = client.chat.completions.create(model=None, messages=user("anything"), tools=TOOLS, max_tokens=12,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}},
                                       extra_body={"ignore_eos": True})
    calls = r.choices[0].message.tool_calls     # cut by max_tokens inside the call: it says length
    assert calls and calls[0].function.name.startswith("get_time") and r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=None, messages=user("x"), tools=TOOLS, max_tokens=5,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    # logprobs of a forced tag: the ruled-out tokens' -inf is written as JSON can (-9999, as vLLM)
    r = client.chat.completions.create(model=None, messages=user("x"), tools=TOOLS, max_tokens=4, logprobs=True,
                                       top_logprobs=2, tool_choice="required")
    assert r.choices[0].logprobs.content[0].top_logprobs[1].logprob == -9999.0


def test_thinking_off_parses_as_content(client):
    for kwargs in ({"enable_thinking": False}, {"reasoning_effort": "none"}):
        r = client.chat.completions.create(model=None, messages=user("PLAIN"), max_tokens=20,
                                           extra_body={"chat_template_kwargs": kwargs})
        assert r.choices[0].message.content == "A plain answer." and not reasoning_of(r.choices[0].message)


def test_reply_without_think_close(client):
    """The model skipped thinking and stopped: the text is also the answer (documented rule)."""
    kw = dict(model=None, messages=user("NOCLOSE"), max_tokens=30)
    msg = client.chat.completions.create(**kw).choices[0].message
    assert msg.content == "An answer without closing"
    assert streamed(client, **kw)[1] == msg.content


def test_seeded_sampling_stream_equals_non_stream_and_n(client):
    kw = dict(model=None, messages=user("hello there"), max_tokens=10, temperature=0.9, seed=3, n=2,
              extra_body={"ignore_eos": True}, logprobs=True, top_logprobs=2)
    r = client.chat.completions.create(**kw)
    assert len(r.choices) == 2 and r.usage.completion_tokens == 20
    for ch in r.choices:
        assert len(ch.logprobs.content) == 10 and all(len(t.top_logprobs) == 2 for t in ch.logprobs.content)
    texts = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            texts.setdefault(ch.index, ["", ""])
            texts[ch.index][0] += ch.delta.content or ""
            texts[ch.index][1] += getattr(ch.delta, "reasoning_content", None) or (
                ch.delta.model_extra or {}).get("reasoning_content") or ""
    for ch in r.choices:
        assert texts[ch.index] == [ch.message.content or "", reasoning_of(ch.message) or ""]


def test_chat_bad_input(server):
    import httpx
    for body, words in [({"messages": []}, "messages"), ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
                        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "logprobs"),
                        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tools"),
                        ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tools": []}},
                         "cannot set tools")]:
        r = httpx.post(server.base + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400 and words in r.json()["message"], (body, r.text)
