"""The agent's LLM client against a real OpenAI-compatible HTTP server on 127.0.0.1 that replays
scripted replies: a tool call comes back parsed with its tokens counted; a 503 is retried; plain
text, an unknown tool and arguments that are not JSON are each counted and answered with a
correction, never an exception; a 400 fails at once with the endpoint's message."""

import json
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from ouro.agent.llm import LLMClient

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "read a file",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]


def reply(content=None, calls=None, status=200):
    if status != 200:
        return status, {"error": {"message": f"scripted {status}", "type": "server_error"}}
    msg = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [{"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
                             for i, (n, a) in enumerate(calls)]
    return 200, {"id": "x", "object": "chat.completion", "created": 0, "model": "scripted",
                 "choices": [{"index": 0, "message": msg, "finish_reason": "tool_calls" if calls else "stop"}],
                 "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}}


@pytest.fixture
def scripted():
    script, seen = [], []
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(body: dict):
        seen.append(body)
        status, doc = script.pop(0)
        return JSONResponse(doc, status_code=status)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}/v1", script, seen
    server.should_exit = True
    thread.join(5)


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
