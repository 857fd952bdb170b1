"""The agent's LLM client against a real OpenAI-compatible HTTP server on 127.0.0.1 that replays
scripted replies: a tool call comes back parsed with its tokens counted; a 503 is retried; plain
text, an unknown tool and arguments that are not JSON are each counted and answered with a
correction, never an exception; a 400 fails at once with the endpoint's message."""

import json

import pytest
from tests.helpers.scripted_llm import ScriptedEndpoint, reply

from ouro.agent.llm import LLMClient

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "read a file",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]


@pytest.fixture
def scripted():
    e = ScriptedEndpoint()
    yield e.url, e.script, e.seen
    e.close()


def test_tool_calls_retries_and_corrections(scripted):
    url, script, seen = scripted
    llm = LLMClient(url, "scripted", backoff_s=0.01)
    script += [reply(status=503), reply(calls=[("read_file", json.dumps({"path": "a.py"}))])]
    r = llm.chat([{"role": "user", "content": "go"}], TOOLS)
    assert [(c.name, c.arguments) for c in r.calls] == [("read_file", {"path": "a.py"})] and r.correction is None
    assert llm.retries == 1 and llm.tokens == {"prompt": 11, "completion": 7}
    assert seen[-1]["tools"][0]["function"]["name"] == "read_file"
    assert r.message["tool_calls"][0]["function"]["name"] == "read_file"
    for bad, word in [(reply(content="I think the bug is in the router."), "called no tool"),
                      (reply(calls=[("rm_rf", "{}")]), "no tool 'rm_rf'"),
                      (reply(calls=[("read_file", "{path: a.py")]), "not JSON"),
                      (reply(calls=[("read_file", "[1, 2]")]), "JSON object")]:
        script.append(bad)
        r = llm.chat([{"role": "user", "content": "go"}], TOOLS)
        assert not r.calls and word in r.correction
    assert llm.invalid == 4 and llm.tokens == {"prompt": 55, "completion": 35}
    script.append(reply(status=400))
    with pytest.raises(Exception, match="scripted 400"):
        llm.chat([{"role": "user", "content": "go"}], TOOLS)
