"""Structured outputs through a real `ouro serve` (tiny-py) and the official `openai` client:
`response_format` json_schema with n > 1, whole and streamed, validates (the `jsonschema`
package); vLLM's and SGLang's extra fields hold on /v1/completions; a strict tool call's arguments
validate against its parameters; with reasoning on, the reasoning is free and the grammar waits
for `</think>`; every malformed constraint is a 400 with the OpenAI error body naming it;
/tokenize and /detokenize round-trip."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.helpers.serve_helpers import Server, idle, post

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                           "units": {"enum": ["c", "f"]}},
          "required": ["city", "days"], "additionalProperties": False}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server("tiny-py", tmp_path=tmp_path_factory.mktemp("structured"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0)


@pytest.mark.processes
def test_json_schema_chat_validates_whole_and_streamed_with_n(client, server):
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
    msgs = [{"role": "user", "content": "the weather as JSON"}]
    r = client.chat.completions.create(model=None, messages=msgs, n=3, temperature=1.0, seed=4, max_tokens=120,
                                       response_format=fmt, extra_body=NO_THINKING)
    for ch in r.choices:
        assert ch.finish_reason == "stop", ch
        jsonschema.validate(json.loads(ch.message.content), SCHEMA)
    texts = {}
    for chunk in client.chat.completions.create(model=None, messages=msgs, n=2, temperature=1.0, seed=5,
                                                max_tokens=120, response_format=fmt, stream=True, extra_body=NO_THINKING):
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
    assert len(texts) == 2
    for t in texts.values():
        jsonschema.validate(json.loads(t), SCHEMA)
    assert idle(server)


@pytest.mark.processes
@pytest.mark.parametrize("extra, ok", [
    ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"structured_outputs": {"regex": "[0-9]{2}:[0-9]{2}"}}, lambda t: re.fullmatch("[0-9]{2}:[0-9]{2}", t)),
    ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
    ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down")),
    ({"regex": "(yes|no)!"}, lambda t: t in ("yes!", "no!")),                       # SGLang's names
    ({"ebnf": 'root ::= "[" [a-z] ("," [a-z])* "]"'}, lambda t: re.fullmatch(r"\[[a-z](,[a-z])*\]", t)),
    ({"json_schema": json.dumps(SCHEMA)}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
])
def test_extra_fields_hold_on_completions(client, extra, ok):
    r = client.completions.create(model=None, prompt=["def f():\n", "x = "], max_tokens=100, temperature=1.0, seed=2,
                                  extra_body=extra)
    for ch in r.choices:
        assert ch.finish_reason == "stop" and ok(ch.text), ch.text


@pytest.mark.processes
def test_a_strict_tool_call_has_arguments_of_its_schema(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": SCHEMA}}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = client.chat.completions.create(model=None, messages=[{"role": "user", "content": "weather in Oslo?"}],
                                           tools=tools, tool_choice=choice, max_tokens=200, temperature=0.8, seed=1,
                                           extra_body=NO_THINKING)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", ch
        (call,) = ch.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA)


@pytest.mark.processes
def test_reasoning_stays_free_and_a_cut_reply_says_length(client):
    r = client.chat.completions.create(model=None, messages=[{"role": "user", "content": "think, then answer"}],
                                       max_tokens=24, temperature=0, extra_body={"guided_choice": ["yes", "no"]})
    ch = r.choices[0]
    assert ch.finish_reason == "length"
    reasoning = ch.message.model_extra.get("reasoning_content") or ""
    assert reasoning and reasoning not in ("yes", "no")       # the reasoning was not held to the choice


@pytest.mark.processes
@pytest.mark.parametrize("body, says", [
    ({"guided_regex": "(("}, "does not compile"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "one structured-output constraint"),
    ({"response_format": {"type": "json_schema"}}, "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}}}, "does not compile"),
    ({"guided_json": {"description": "x" * 70000}}, "over the limit"),
    ({"guided_choice": []}, "choice"),
    ({"response_format": {"type": "xml"}}, "response_format"),
])
def test_bad_constraints_are_400s_naming_the_problem(server, body, says):
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 4, **body})
    assert r.status_code == 400 and r.json()["object"] == "error" and says in r.json()["message"], r.json()
    assert idle(server)


@pytest.mark.processes
def test_tokenize_and_detokenize(server):
    r = post(server, "/tokenize", {"prompt": "hello world", "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) and r["max_model_len"] > 0
    back = post(server, "/detokenize", {"tokens": r["tokens"]}).json()
    assert back["prompt"] == back["text"] == "hello world"
    msgs = [{"role": "user", "content": "hi"}]
    chat = post(server, "/tokenize", {"messages": msgs}).json()
    used = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    assert chat["count"] == used
    bad = post(server, "/detokenize", {"tokens": [10 ** 9]})
    assert bad.status_code == 400 and "out of range" in bad.json()["message"]
    assert post(server, "/tokenize", {"prompt": "a", "messages": msgs}).status_code == 400


@pytest.mark.processes
def test_responses_api_whole_streamed_with_tools_and_format(client, server):
    """/v1/responses over the chat path: the same greedy text whole and streamed (events in order),
    a strict function call as a function_call item, tool results fed back as items, text.format."""
    kw = dict(model=None, input="hello", max_output_tokens=16, temperature=0, reasoning={"effort": "none"})
    whole = client.responses.create(**kw)
    assert whole.object == "response" and whole.output[-1].type == "message"
    assert whole.usage.output_tokens == 16 and whole.status == "incomplete"
    assert whole.incomplete_details.reason == "max_output_tokens"
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text == whole.output_text
    tools = [{"type": "function", "name": "get_weather", "strict": True, "parameters": SCHEMA}]
    r = client.responses.create(model=None, input="weather?", tools=tools, tool_choice="required",
                                max_output_tokens=200, temperature=0, reasoning={"effort": "none"})
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), SCHEMA)
    follow = client.responses.create(model=None, max_output_tokens=8, temperature=0, reasoning={"effort": "none"},
                                     input=[{"role": "user", "content": "weather?"},
                                            {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                             "arguments": call.arguments},
                                            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    alone = client.responses.create(model=None, max_output_tokens=1, temperature=0, reasoning={"effort": "none"},
                                    input=[{"role": "user", "content": "weather?"}])
    assert follow.output and follow.usage.input_tokens > alone.usage.input_tokens + 5     # the call and its result
    fmt = client.responses.create(model=None, input="json", max_output_tokens=120, temperature=0,
                                  reasoning={"effort": "none"},
                                  text={"format": {"type": "json_schema", "name": "w", "schema": SCHEMA}})
    jsonschema.validate(json.loads(fmt.output_text), SCHEMA)
    for bad, says in [({"previous_response_id": "resp_1"}, "stores no responses"),
                      ({"input": [{"type": "web_search_call"}]}, "input"), ({"input": []}, "input")]:
        got = post(server, "/v1/responses", {"input": "x", **bad})
        assert got.status_code == 400 and says in got.json()["message"], got.json()
    assert idle(server)


@pytest.mark.processes
@pytest.mark.parametrize("case", ["reasoning and text", "forced call", "text"])
def test_responses_stream_announces_the_items_the_response_lists(client, case):
    """Each streamed item opens (output_item.added) at the index the final response lists it at, with
    its deltas under that index, and the final output equals the non-streamed one: the stream had
    numbered the message 0 and calls 1 + k while the response put reasoning first (and never
    streamed the reasoning)."""
    tools = [{"type": "function", "name": "get_weather", "strict": True, "parameters": SCHEMA}]
    kw = {"reasoning and text": dict(input="hi", max_output_tokens=40),
          "forced call": dict(input="weather?", tools=tools, tool_choice="required", max_output_tokens=200,
                              reasoning={"effort": "none"}),
          "text": dict(input="hello", max_output_tokens=12, reasoning={"effort": "none"})}[case]
    kw.update(model=None, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    final = events[-1].response.output
    added = {e.output_index: e.item for e in events if e.type == "response.output_item.added"}
    done = {e.output_index: e.item for e in events if e.type == "response.output_item.done"}
    assert sorted(added) == sorted(done) == list(range(len(final)))
    for i, item in enumerate(final):
        assert added[i].type == done[i].type == item.type and added[i].id == done[i].id == item.id
        assert done[i].model_dump() == item.model_dump()
    for e in events:        # every delta under its own item's index
        if e.type.endswith(".delta"):
            assert added[e.output_index].id == e.item_id
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    def same(o):       # ids differ between two responses
        return {k: v for k, v in o.model_dump().items() if k not in ("id", "call_id")}
    assert [same(o) for o in final] == [same(o) for o in whole.output]
    assert text == whole.output_text
    kinds = [o.type for o in final]
    if case == "reasoning and text":
        assert kinds[0] == "reasoning" and thought == final[0].content[0].text != ""
    if case == "forced call":
        assert "function_call" in kinds


@pytest.mark.processes
def test_a_strict_call_streams_the_arguments_it_returns_whole(client):
    """A strict call's string values drop the grammar's formatting blanks, streamed as whole: the
    argument deltas concatenate to the non-streamed arguments, which validate."""
    tools = [{"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": SCHEMA}}]
    kw = dict(model=None, messages=[{"role": "user", "content": "Oslo?"}], tools=tools, tool_choice="required",
              max_tokens=200, temperature=0.9, seed=11, extra_body=NO_THINKING)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls[0].function.arguments
    parts = [tc.function.arguments or "" for chunk in client.chat.completions.create(**kw, stream=True)
             for ch in chunk.choices for tc in (ch.delta.tool_calls or [])]
    assert "".join(parts) == whole
    jsonschema.validate(json.loads(whole), SCHEMA)


@pytest.mark.parametrize("raw", ["", " ", "\\n", " a", "a ", " a b \\n", "\\n\\nab\\n\\n", "x"])
def test_trimming_a_strict_value_keeps_every_open_form_a_prefix(raw):
    from ouro.serve.tool_args import trim_formatting
    raw = raw.replace("\\\\n", "\\n")
    final = trim_formatting(raw)
    assert all(final.startswith(trim_formatting(raw[:k])) for k in range(len(raw) + 1))
    assert len(raw) - len(final) <= 2 and final in raw


@pytest.mark.parametrize("spec", [{"type": "json_schema", "schema": SCHEMA}, {"type": "regex", "regex": "a+"},
                                  {"type": "choice", "choice": ["x"]}, {"type": "grammar", "grammar": 'root ::= "a"'}])
def test_the_frontend_checks_a_grammar_without_compiling_it(monkeypatch, spec):
    """The server's 400 check builds the grammar only: the compile against the vocabulary happens
    once, in the engine (here no compiler may even be made)."""
    import asyncio

    import xgrammar as xg

    from ouro.serve.protocol import ServeError
    from ouro.serve.structured_request import check

    def no_compiler(*a, **k):
        raise AssertionError("the frontend made a grammar compiler")
    monkeypatch.setattr(xg, "GrammarCompiler", no_compiler)
    asyncio.run(check(spec))
    with pytest.raises(ServeError) as e:
        asyncio.run(check({**spec, "type": "regex", "regex": "(("}))
    assert e.value.status == 400 and "does not compile" in str(e.value)
