"""A small OpenAI-compatible chat endpoint on 127.0.0.1 that replays a scripted conversation:
each POST to /v1/chat/completions pops the next (status, body) from the script and records the
request it got. A reply may also be a function of the request (to answer what the harness said)."""

import json
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse


def reply(content=None, calls=None, status=200):
    """One scripted reply: text, tool calls [(name, arguments: JSON text or a dict)], or an error."""
    if status != 200:
        return status, {"error": {"message": f"scripted {status}", "type": "server_error"}}
    msg = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [{"id": f"call_{time.monotonic_ns()}_{i}", "type": "function",
                              "function": {"name": n, "arguments": a if isinstance(a, str) else json.dumps(a)}}
                             for i, (n, a) in enumerate(calls)]
    return 200, {"id": "x", "object": "chat.completion", "created": 0, "model": "scripted",
                 "choices": [{"index": 0, "message": msg, "finish_reason": "tool_calls" if calls else "stop"}],
                 "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}}


def call(name, **arguments):
    return reply(calls=[(name, arguments)])


class ScriptedEndpoint:
    def __init__(self):
        self.script, self.seen = [], []
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(body: dict):
            self.seen.append(body)
            if not self.script:
                return JSONResponse({"error": {"message": "the script is over", "type": "invalid_request_error"}},
                                    status_code=400)
            status, doc = self.script.pop(0)
            return JSONResponse(doc, status_code=status)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/v1"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)

    def tool_results(self) -> list[str]:
        """What the harness answered each tool call with, in order (from the last request's history)."""
        if not self.seen:
            return []
        return [m["content"] for m in self.seen[-1]["messages"] if m["role"] == "tool"]

    def close(self):
        self.server.should_exit = True
        self.thread.join(5)
