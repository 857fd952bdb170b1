"""The server's limits on what one request may ask: every POST body capped, tokenizing off the event
loop, bounded stop lists, the queue counted in sequences, parts it cannot read refused, requests other
servers refuse, and the one a full context may still ask (scoring with max_tokens 0)."""

import json
import random

import httpx
import pytest

from tests.helpers.serve_helpers import idle, post
# the same tiny server as test_serve.py's (its fixtures, not a copy: module-scoped, so one server here)
from tests.serve.test_serve import model_dir, server  # noqa: F401

pytestmark = pytest.mark.processes


def test_every_post_body_is_capped_not_only_generation(server):
    """/tokenize and /detokenize read their bodies under the same cap: a large body's tokenizing
    held the event loop (a 48 MB one blocked /health for 109 s)."""
    for path, body in (("/tokenize", {"prompt": "x" * 300_000}), ("/detokenize", {"tokens": [1] * 80_000})):
        r = post(server, path, None, raw=json.dumps(body).encode())
        assert r.status_code == 413 and "body" in r.json()["message"], path
    assert post(server, "/tokenize", {"prompt": "hi"}).status_code == 200


def test_tokenizing_runs_off_the_event_loop(model_dir):
    """/tokenize and /detokenize encode and decode on a worker thread (a few MB of prompt took
    seconds, and held /health on the event loop): the real tokenizer, its calls' threads recorded."""
    import asyncio
    import threading
    import types

    from fastapi import FastAPI

    from ouro.models.resolve import load_tokenizer
    from ouro.serve.tokenize_routes import add_tokenize_routes
    real, seen = load_tokenizer(model_dir), []

    class Recording:
        def encode(self, *a, **k):
            seen.append(threading.current_thread())
            return real.encode(*a, **k)

        def decode(self, *a, **k):
            seen.append(threading.current_thread())
            return real.decode(*a, **k)
    app = FastAPI()
    state = types.SimpleNamespace(tokenizer=Recording(), chat=None, vocab_size=real.get_vocab_size(),
                                  max_model_len=64, model_name="m", tokenizer_info={})
    add_tokenize_routes(app, state)

    async def calls():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            ids = (await c.post("/tokenize", json={"prompt": "hello there"})).json()["tokens"]
            text = (await c.post("/detokenize", json={"tokens": ids})).json()["text"]
            return ids, text, threading.current_thread()
    ids, text, loop_thread = asyncio.run(calls())
    assert ids == real.encode("hello there").ids and text == real.decode(ids, skip_special_tokens=False)
    assert len(seen) == 2 and all(t is not loop_thread for t in seen)


def test_a_stop_id_past_the_vocabulary_is_refused(server):
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop_token_ids": [3, 10 ** 9]})
    assert r.status_code == 400 and "stop_token_ids out of range" in r.json()["message"], r.text


@pytest.mark.parametrize("field,n,ok", [("stop", 64, True), ("stop", 65, False), ("stop_token_ids", 1025, False)])
def test_stop_lists_are_bounded(server, field, n, ok):
    value = [f"s{i}" for i in range(n)] if field == "stop" else list(range(n))
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, field: value})
    assert (r.status_code == 200) == ok, r.text
    if not ok:
        assert r.status_code == 400 and field in r.json()["message"]


def test_the_queue_limit_counts_sequences_not_requests(server):
    """--max-num-seqs 8 + --max-queued-requests 110: 118 sequences (prompts x n) at once. One request
    of 150 prompts x n 128 had been admitted as one place and held every other client for minutes."""
    r = post(server, "/v1/completions", {"prompt": ["ab"] * 12, "n": 10, "max_tokens": 1})
    assert r.status_code == 400 and "120 sequences" in r.json()["message"] and "--max-queued-requests" in r.json()["message"]
    body = {"prompt": ["ab cd"] * 10, "n": 10, "max_tokens": 1000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.base + "/v1/completions", json=body, headers=server.headers(), timeout=60) as big:
        assert big.status_code == 200
        lines = big.iter_lines()        # (kept: a dropped iterator closes the stream)
        next(lines)                                             # its 100 sequences are in flight
        r = post(server, "/v1/completions", {"prompt": ["ab", "cd"], "n": 10, "max_tokens": 1})
        assert r.status_code == 429 and "sequences in flight" in r.json()["message"]
    assert idle(server)                                        # the stream's places given back when it closed
    assert post(server, "/v1/completions", {"prompt": ["ab", "cd"], "n": 10, "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize("part", [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
                                  {"type": "file", "file": {"file_data": "x"}}, {"type": "banana"},
                                  {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}])
def test_a_part_a_text_model_cannot_read_is_refused_not_dropped(server, part):
    """It had answered 200 with the prompt of an empty message: the model never saw the input."""
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}], "max_tokens": 1}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 400 and "messages[0].content[1]" in r.json()["message"], r.text


@pytest.mark.parametrize("path,body,says", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/responses", {"input": "", "max_output_tokens": 1}, "input"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "banana"},
     "reasoning_effort")])
def test_requests_other_servers_refuse_are_refused(server, path, body, says):
    r = post(server, path, body)
    assert r.status_code == 400 and says in r.json()["message"], r.text


def test_a_prompt_of_the_whole_context_is_scored_with_max_tokens_0(server):
    """lm-eval's loglikelihood of a full-context window: nothing is generated, so it fits."""
    n = post(server, "/tokenize", {"prompt": "x"}).json()["max_model_len"]
    ids = [random.Random(5).randrange(3, 500) for _ in range(n)]
    r = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert len(lp) == n and lp[0] is None and all(isinstance(x, float) for x in lp[1:])
    r = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 1})
    assert r.status_code == 400 and "maximum context length" in r.json()["message"]
