"""The published schema declares what the server refuses (issue 38, part 5): the rules a plain
`schemathesis run` found only in the server are each checked here on both sides, the body models'
JSON Schema (what `/openapi.json` publishes) and the server's own code, without a server."""

import itertools
import json

import jsonschema
import pytest

from ouro.serve.chat_template import normalize_messages
from ouro.serve.protocol import CONSTRAINTS, ChatCompletionRequest, CompletionRequest, ServeError
from ouro.serve.responses import ResponsesRequest
from ouro.serve.structured_request import spec_for

# one value of each constraint field that asks for a constraint
VALUES = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
          "structured_outputs.json": {"type": "object"}, "structured_outputs.regex": "[a-z]",
          "structured_outputs.choice": ["a", "b"], "structured_outputs.grammar": 'root ::= "a"',
          "structured_outputs.json_object": True, "guided_json": {"type": "object"}, "guided_regex": "[a-z]",
          "guided_choice": ["a"], "guided_grammar": 'root ::= "a"', "json_schema": '{"type": "object"}',
          "regex": "[a-z]", "ebnf": 'root ::= "a"'}
FORCED = {name: {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"},
                                                            "strict": strict}}], "tool_choice": choice}
          for name, strict, choice in (("forced_call", False, "required"), ("forced_strict_call", True, "required"),
                                       ("named_call", False, {"type": "function", "function": {"name": "f"}}))}


def _with(body: dict, *names: str) -> dict:
    body = json.loads(json.dumps(body))
    for name in names:
        if name in FORCED:
            body.update(json.loads(json.dumps(FORCED[name])))
            continue
        head, _, tail = name.partition(".")
        if tail:
            body.setdefault(head, {})[tail] = VALUES[name]
        else:
            body[name] = VALUES[name]
    return body


def _validator(model):
    return jsonschema.Draft202012Validator(model.model_json_schema())


def _server_refuses(model, body) -> bool:
    try:
        spec_for(None, model.model_validate(body))
    except ServeError as e:
        assert e.status == 400 and "one structured-output constraint" in e.message, e.message
        return True
    return False


ROUTES = [(CompletionRequest, {"prompt": "x"}, list(CONSTRAINTS)),
          (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]}, [*CONSTRAINTS, *FORCED])]


def test_every_constraint_has_a_value():
    assert set(VALUES) == set(CONSTRAINTS)


@pytest.mark.parametrize("model,base,names", ROUTES, ids=["completions", "chat"])
def test_one_constraint_valid_two_refused_on_both_sides(model, base, names):
    schema = _validator(model)
    for name in names:
        body = _with(base, name)
        assert not list(schema.iter_errors(body)), name
        assert not _server_refuses(model, body), name
    for a, b in itertools.combinations(names, 2):
        if a in FORCED and b in FORCED:
            continue     # one tool_choice
        body = _with(base, a, b)
        assert list(schema.iter_errors(body)), f"the schema takes {a} with {b}"
        assert _server_refuses(model, body), f"the server takes {a} with {b}"


@pytest.mark.parametrize("model,base", [(CompletionRequest, {"prompt": "x"}),
                                        (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]})])
def test_a_constraint_that_asks_for_nothing_is_not_counted(model, base):
    body = {**base, "response_format": {"type": "text"}, "structured_outputs": {"json_object": False},
            "guided_regex": "[a-z]"}
    assert not list(_validator(model).iter_errors(body))
    assert not _server_refuses(model, body)


ARGUMENTS = ["{", "{} x", "[1]", "1", '"s"', "{'a': 1}", '{"a": }', '{"a": 1}', " {} ", "", "  ", '{"a": {"b": [1]}}']


def _json_object_text(text: str) -> bool:
    try:
        return not text.strip() or isinstance(json.loads(text), dict)
    except ValueError:
        return False


@pytest.mark.parametrize("text", ARGUMENTS)
def test_tool_call_arguments_text_declared_as_the_server_reads_it(text):
    """A past tool call's string arguments: the server takes JSON text of an object (or blank). The
    schema says so with contentMediaType/contentSchema, and its pattern alone already refuses text
    that cannot be an object (the boundary values a generator draws from the pattern)."""
    body = {"messages": [{"role": "assistant", "content": None,
                          "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": text}}]}]}
    server_takes = True
    try:
        normalize_messages(ChatCompletionRequest.model_validate(body).messages)
    except ValueError:
        server_takes = False
    assert server_takes == _json_object_text(text)
    args = ChatCompletionRequest.model_json_schema()["$defs"]["CalledFunction"]["properties"]["arguments"]
    text_forms = [s for s in args["anyOf"] if s.get("type") == "string"]
    matched = [s for s in text_forms if jsonschema.Draft202012Validator(s).is_valid(text)]
    # the content keywords asserted: a JSON form holds only for text that parses to an object
    asserted = [s for s in matched if "contentMediaType" not in s or _json_object_text(text)]
    assert bool(asserted) == server_takes, (text, matched)
    shaped = text.strip().startswith("{") and text.strip().endswith("}")
    if not server_takes and not shaped:
        assert not matched, f"the pattern alone takes {text!r}"
    assert all(_json_object_text(e) for s in text_forms for e in s.get("examples", []))


def test_responses_function_call_arguments_declared():
    schema = ResponsesRequest.model_json_schema()
    args = schema["$defs"]["FunctionCallItem"]["properties"]["arguments"]
    assert any(s.get("contentMediaType") == "application/json" for s in args["anyOf"])
    bad = {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]}
    assert list(jsonschema.Draft202012Validator(schema).iter_errors(bad))


def test_responses_json_schema_format_needs_its_schema():
    schema = jsonschema.Draft202012Validator(ResponsesRequest.model_json_schema())
    for fmt, ok in (({"type": "json_schema"}, False), ({"type": "json_schema", "schema": None}, False),
                    ({"type": "json_schema", "schema": {"type": "object"}}, True), ({"type": "text"}, True)):
        body = {"input": "x", "text": {"format": fmt}}
        assert (not list(schema.iter_errors(body))) == ok, fmt
        try:
            ResponsesRequest.model_validate(body)
            server_takes = True
        except ValueError as e:
            server_takes = False
            assert "needs its schema" in str(e)
        assert server_takes == ok, fmt
