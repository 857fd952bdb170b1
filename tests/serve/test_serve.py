"""`ouro serve` as a real process on 127.0.0.1, driven by the official `openai` client and httpx."""

import asyncio
import json
import os
import random
import re
import subprocess
import sys

import httpx
import openai
import pytest

from tests.helpers.serve_helpers import ROOT, Server, idle, post

pytestmark = pytest.mark.processes

KEY = "test-key"


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    return tiny_checkpoint


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = Server(model_dir, "--max-num-seqs", "8", "--max-queued-requests", "110", "--max-request-body-bytes", "200000",
               tmp_path=tmp_path_factory.mktemp("serve_logs"), api_key=KEY)
    yield s
    s.stop()


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0)


def test_completions_stream_equals_non_stream(client):
    kw = dict(model="serve_tiny0", prompt="The engine", max_tokens=12, temperature=0.8, seed=5, extra_body={"ignore_eos": True})
    models = client.models.list()
    kw["model"] = models.data[0].id
    full = client.completions.create(**kw)
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    assert full.choices[0].text == streamed and full.usage.completion_tokens == 12
    assert full.choices[0].finish_reason == "length" and full.choices[0].logprobs is None


def test_server_output_equals_the_offline_engine(client, model_dir):
    """Same checkpoint, same prompt: the server (engine process, JSON wire, frontend detokeniser)
    gives the offline engine's text, greedy and seeded."""
    from ouro import LLM, SamplingParams
    llm = LLM(str(model_dir), max_memory=64 << 20, page_size=16)
    for temperature, seed in ((0, None), (0.9, 4)):
        want = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(
            temperature=temperature, seed=seed, max_tokens=12, ignore_eos=True))[0]
        got = client.completions.create(model=None, prompt=[5, 6, 7, 8], max_tokens=12, temperature=temperature,
                                        seed=seed, extra_body={"ignore_eos": True}).choices[0]
        assert got.text == want.text and len(want.token_ids) == 12


@pytest.fixture(scope="module")
def offline(model_dir):
    from ouro import LLM
    return LLM(str(model_dir), max_memory=64 << 20, page_size=16)


@pytest.mark.parametrize("how", ["stop_token_id", "stop_string", "length"])
def test_server_text_equals_the_offline_engine_at_every_kind_of_stop(client, offline, how):
    """A stop token id's text is not part of the reply, a stop string ends it where it starts,
    `max_tokens` releases what was held back: the same rules (one piece of code) served and offline."""
    from ouro import SamplingParams
    prompt = [5, 6, 7, 8]
    free = offline.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    kw = {}
    if how == "stop_token_id":
        kw["stop_token_ids"] = [free.token_ids[4]]
    elif how == "stop_string":
        kw["stop"] = [free.text[len(free.text) // 2:len(free.text) // 2 + 2]]
    want = offline.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12,
                                                                        ignore_eos=True, **kw))[0]
    got = client.completions.create(model=None, prompt=prompt, max_tokens=12, temperature=0, stop=kw.get("stop"),
                                    extra_body={"ignore_eos": True, "stop_token_ids": kw.get("stop_token_ids")}).choices[0]
    assert (got.text, got.finish_reason) == (want.text, want.finish_reason)
    assert want.finish_reason == ("length" if how == "length" else "stop") and len(want.text) < len(free.text) + (how == "length")
    if how == "stop_token_id":           # the reply is the text of the ids before the stop token
        k = free.token_ids.index(kw["stop_token_ids"][0])
        assert want.token_ids[-1] == free.token_ids[k] and want.text == offline.engine.tokenizer.decode(free.token_ids[:k])


def test_n_logprobs_and_seed(client):
    r = client.completions.create(model=None, prompt="abc", max_tokens=6, n=3, seed=9, temperature=1.0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert len({c.text for c in r.choices}) == 3
    for c in r.choices:
        assert len(c.logprobs.token_logprobs) == 6 and all(len(t) <= 2 for t in c.logprobs.top_logprobs)
    again = client.completions.create(model=None, prompt="abc", max_tokens=6, n=3, seed=9, temperature=1.0,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == [
        c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert r.usage.completion_tokens == 18


def test_tokens_as_token_ids_name_the_offline_engines_tokens(client, model_dir):
    """vLLM's return_tokens_as_token_ids: each logprob entry names its token by id, so two tokens
    of the same text stay apart; the ids and logprobs are the offline engine's."""
    from ouro import LLM, SamplingParams
    llm = LLM(str(model_dir), max_memory=64 << 20, page_size=16)
    want = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(temperature=0, max_tokens=8,
                                                                           ignore_eos=True, logprobs=2))[0].outputs[0]
    got = client.completions.create(model=None, prompt=[5, 6, 7, 8], max_tokens=8, temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}).choices[0]
    assert [int(t.removeprefix("token_id:")) for t in got.logprobs.tokens] == want.token_ids
    for top, ref in zip(got.logprobs.top_logprobs, want.top_logprobs):
        assert {int(k.removeprefix("token_id:")): v for k, v in top.items()} == pytest.approx(dict(ref), abs=1e-4)
    chat = client.chat.completions.create(model=None, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"return_tokens_as_token_ids": True})
    assert all(re.fullmatch(r"token_id:\d+", e.token) and all(re.fullmatch(r"token_id:\d+", t.token)
                                                               for t in e.top_logprobs)
               for e in chat.choices[0].logprobs.content)
    plain = client.completions.create(model=None, prompt=[5, 6, 7, 8], max_tokens=8, temperature=0, logprobs=2,
                                      extra_body={"ignore_eos": True}).choices[0]
    assert "".join(plain.logprobs.tokens) == got.text and not plain.logprobs.tokens[0].startswith("token_id:")
    assert got.logprobs.text_offset == plain.logprobs.text_offset


def test_an_image_to_a_text_only_model_is_a_400(server):
    import base64
    url = "data:image/png;base64," + base64.b64encode(b"\x89PNG not really").decode()
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": url}}]}], "max_tokens": 2})
    assert r.status_code == 400 and "text only" in r.json()["message"], r.text


def test_metrics_record_requests(server, client):
    before = server.metrics()
    client.completions.create(model=None, prompt="metrics", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    after = server.metrics()
    delta = lambda name: sum(v for k, v in after.items() if k.split("{")[0] == name) - sum(
        v for k, v in before.items() if k.split("{")[0] == name)
    assert delta("ouro:generation_tokens_total") == 5 and delta("ouro:prompt_tokens_total") >= 1
    for h in ("ouro:time_to_first_token_seconds", "ouro:e2e_request_latency_seconds", "ouro:request_queue_time_seconds"):
        assert delta(h + "_count") == 1, h
    assert delta("ouro:inter_token_latency_seconds_count") == 4
    assert after['ouro:request_success_total{finished_reason="length",model_name="%s"}' % client.models.list().data[0].id] >= 1
    assert {"ouro:kv_pages_total", "ouro:state_slots_total", "ouro:prefix_cache_hit_rate", "ouro:num_preemptions",
            "ouro:num_requests_running", "ouro:num_requests_waiting"} <= {k.split("{")[0] for k in after}


def test_token_id_prompt_and_stop_string(client):
    base = client.completions.create(model=None, prompt=[5, 6, 7], max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert len(base) >= 3
    stop = base[2:4]
    cut = client.completions.create(model=None, prompt=[5, 6, 7], max_tokens=10, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == base[:base.index(stop)]


@pytest.mark.parametrize("body,status,words", [
    (None, 400, "JSON"),
    ({"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "n": 0}, 400, "n"),
    ({"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ({"prompt": "hi", "model": "gpt-5"}, 404, "does not exist"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": [1, 10 ** 9]}, 400, "out of range"),
    ({"prompt": "hi", "max_tokens": 5000}, 400, "maximum context length is 4096 tokens"),
    ({"prompt": "hi", "presence_penalty": 1.0}, 400, "presence_penalty"),
    ({"prompt": "hi", "logit_bias": {"5": 10}}, 400, "logit_bias"),
    ({"prompt": "hi", "response_format": {"type": "xml"}}, 400, "response_format"),
    ({"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ({"prompt": "hi", "made_up_field": 1}, 400, "made_up_field: unknown field"),
    ({"prompt": "hi", "stream": True, "prompt_logprobs": 1}, 400, "prompt_logprobs"),
    ({"prompt": "hi", "stop": 5}, 400, "stop"),
    ({"prompt": ""}, 400, "prompt must be a non-empty string"),
    ({"prompt": "hi", "echo": 0}, 400, "echo"),   # no coercion: 0 is not false
    (b'{"prompt": "a\\ud800b"}', 400, "not Unicode text"),   # a lone surrogate: 400, not a tokenizer error
])
def test_bad_input_gets_400_with_openai_error_body(server, body, status, words):
    raw = b"{not json" if body is None else body if isinstance(body, bytes) else None
    r = post(server, "/v1/completions", body, raw=raw)
    assert r.status_code == status
    err = r.json()
    assert set(err) >= {"object", "message", "type", "code"} and err["object"] == "error" and err["code"] == status
    assert words in err["message"]


def test_api_key_on_every_route_but_health(server):
    for path in ("/v1/models", "/metrics"):
        assert httpx.get(server.base + path).status_code == 401
        assert httpx.get(server.base + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert post(server, "/v1/completions", {"prompt": "hi"}, key=None).status_code == 401
    assert post(server, "/v1/chat/completions", {"messages": []}, key="nope").json()["code"] == 401
    assert httpx.get(server.base + "/health").status_code == 200


def test_body_over_the_limit_is_refused_before_parsing(server):
    big = json.dumps({"prompt": "x" * 300_000}).encode()
    r = post(server, "/v1/completions", None, raw=big)
    assert r.status_code == 413 and "body" in r.json()["message"]

    def chunks():   # no Content-Length: the limit still holds
        for i in range(0, len(big), 50_000):
            yield big[i:i + 50_000]
    r = httpx.post(server.base + "/v1/completions", content=chunks(), timeout=30,
                   headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"})
    assert r.status_code == 413


def test_openapi_matches_the_routes(server):
    spec = httpx.get(server.base + "/openapi.json", headers=server.headers()).json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"} <= set(spec["paths"])
    for path in ("/v1/completions", "/v1/chat/completions"):   # the errors it really returns
        codes = set(spec["paths"][path]["post"]["responses"])
        assert {"200", "400", "401", "413", "429", "503"} <= codes and "422" not in codes
    props = spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"messages", "tools", "tool_choice", "stream_options", "max_completion_tokens", "chat_template_kwargs"} <= set(props)


def test_every_route_answers_methods_it_lacks_with_allow(server):
    h = server.headers()
    r = httpx.request("TRACE", server.base + "/health")
    assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD, OPTIONS" and r.json()["code"] == 405
    r = httpx.request("OPTIONS", server.base + "/v1/completions", headers=h)
    assert r.status_code == 204 and r.headers["allow"] == "OPTIONS, POST"
    r = httpx.head(server.base + "/v1/models", headers=h)
    assert r.status_code == 200 and r.content == b"" and int(r.headers["content-length"]) > 0
    assert httpx.request("PUT", server.base + "/metrics").status_code == 401   # the API key first
    assert httpx.get(server.base + "/nope", headers=h).status_code == 404


async def _stream_one(base, i, disconnect_after):
    body = {"prompt": f"client {i}", "max_tokens": 40, "temperature": 0, "stream": True, "ignore_eos": True}
    got = ""
    async with httpx.AsyncClient(timeout=120) as c:
        async with c.stream("POST", base + "/v1/completions", json=body,
                            headers={"Authorization": f"Bearer {KEY}"}) as r:
            if r.status_code != 200:
                return ("status", r.status_code)
            n = 0
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    n += 1
                    chunk = json.loads(line[6:])
                    got += "".join(ch.get("text", "") for ch in chunk["choices"])
                    if disconnect_after is not None and n >= disconnect_after:
                        return ("left", n)
    return ("done", got)


@pytest.mark.slow
def test_100_streams_a_third_disconnecting(server):
    rng = random.Random(0)
    plan = [rng.randrange(1, 30) if i % 3 == 0 else None for i in range(100)]

    async def run():
        return await asyncio.gather(*[_stream_one(server.base, i, d) for i, d in enumerate(plan)])
    results = asyncio.run(run())
    assert all(r[0] != "status" for r in results), [r for r in results if r[0] == "status"][:3]
    assert sum(r[0] == "left" for r in results) == 34 and sum(r[0] == "done" for r in results) == 66
    assert idle(server), server.metrics()
    # still answers, and correctly: a finished stream equals the same request made afresh
    i = next(k for k, d in enumerate(plan) if d is None)
    fresh = post(server, "/v1/completions", {"prompt": f"client {i}", "max_tokens": 40, "temperature": 0,
                                             "ignore_eos": True}).json()
    assert fresh["choices"][0]["text"] == results[i][1]


def test_non_streaming_client_that_gives_up_aborts_its_request(server):
    before = server.metric("ouro:generation_tokens_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base + "/v1/completions", headers=server.headers(), timeout=1.5,
                   json={"prompt": "a long one", "max_tokens": 4000, "temperature": 0, "ignore_eos": True})
    assert idle(server, timeout=5), server.metrics()
    # stopped early, not run to the end (a fast machine could otherwise finish 4000 tokens in time)
    assert server.metric("ouro:generation_tokens_total") - before < 4000


def test_schemathesis_every_check_passes(server, tmp_path):
    """The published schema is the truth: `schemathesis run --checks all` against the live server
    (no 5xx; statuses, content types, headers and bodies as documented; schema-valid bodies served
    and invalid ones refused; 405 with Allow; the API key not ignored), the same cases every run.
    tests/helpers/schemathesis_hooks.py keeps valid requests short and within the rules the schema can only
    describe."""
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.helpers.schemathesis_hooks",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, "-m", "schemathesis.cli", "run", server.base + "/openapi.json",
                          "--checks", "all", "--max-examples", "25", "--generation-deterministic",
                          "--workers", "1", "--max-response-time", "30",
                          "--request-timeout", "60", "-H", f"Authorization: Bearer {KEY}", "--no-color"],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)   # its cache: tmp
    assert run.returncode == 0 and "No issues found" in run.stdout, run.stdout[-6000:] + run.stderr[-2000:]
    assert int(re.search(r"(\d+) generated", run.stdout).group(1)) >= 300, run.stdout[-3000:]   # it really ran
    assert idle(server, timeout=60)
