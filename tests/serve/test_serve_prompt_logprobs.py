"""A prompt's own logprobs through the OpenAI API on a real `ouro serve` of tiny-py: completions'
`echo` (with logprobs / top logprobs, max_tokens 0 and 1, streamed, batched prompts, n), vLLM's
`prompt_logprobs` on completions and chat, all against the offline engine; `/tokenizer_info`;
the one rule for fields (undeclared or unimplemented: a 400 naming it); an unknown model as
vLLM's 404; a form-encoded body told to send JSON; and no page or slot left held."""

import json

import httpx
import openai
import pytest

from tests.helpers.serve_helpers import Server, idle, post

pytestmark = pytest.mark.processes

TOL = 1e-5
PROMPTS = ["def read_lines(path):\n    with open(path) as f:\n", "import os\nimport sys\n"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server("tiny-py", "--max-num-seqs", "8", tmp_path=tmp_path_factory.mktemp("prompt_logprobs_logs"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def llm():
    from ouro import LLM
    return LLM("tiny-py", max_memory=64 << 20, page_size=16)


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)


def offline(llm, prompt, k, max_tokens=1):
    from ouro import SamplingParams
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, prompt_logprobs=k,
                                               logprobs=k))[0]


def check_echo(llm, choice, prompt, k, max_tokens, as_ids=False):
    """A choice of echo + logprobs=k: the prompt's text then the completion's; one entry per prompt
    token (the first null) then per generated token, equal to the offline engine's. `as_ids`: the
    request named tokens by id (exact where two tokens' texts are the same)."""
    name = (lambda _, t: f"token_id:{t}") if as_ids else (lambda llm, t: llm.engine.tokenizer.decode([t]))
    want = offline(llm, prompt, k, max(max_tokens, 1))
    ids = want.prompt_token_ids
    gen = want.token_ids[:max_tokens]
    lp = choice["logprobs"]
    assert choice["text"] == prompt + llm.engine.tokenizer.decode(gen) and choice["finish_reason"] == "length"
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + len(gen)
    assert lp["tokens"] == [name(llm, t) for t in ids + gen]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and lp["text_offset"][0] == 0
    assert lp["text_offset"] == sorted(lp["text_offset"])
    for p in range(1, len(ids)):
        entry = want.prompt_logprobs[p]
        assert abs(lp["token_logprobs"][p] - entry[ids[p]]) < TOL
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:k]
        got = lp["top_logprobs"][p] if k else None
        if not k:
            assert got is None
            continue
        assert set(got) == {name(llm, t) for t, _ in top} and len(got) == k
        assert all(abs(got[name(llm, t)] - v) < TOL for t, v in top)
    for j, t in enumerate(gen):           # the generated token: the offline engine's greedy pick
        assert abs(lp["token_logprobs"][len(ids) + j] - want.outputs[0].logprobs[j]) < TOL
    return want


@pytest.mark.parametrize("max_tokens", [0, 1])
@pytest.mark.parametrize("k", [0, 1, 3])
def test_echo_with_logprobs_equals_the_offline_prompt_logprobs(server, client, llm, max_tokens, k):
    r = client.completions.create(model="tiny-py", prompt=PROMPTS[0], echo=True, logprobs=k, max_tokens=max_tokens,
                                  temperature=0, extra_body={"return_tokens_as_token_ids": True}).model_dump()
    check_echo(llm, r["choices"][0], PROMPTS[0], k, max_tokens, as_ids=True)
    assert r["usage"]["completion_tokens"] == max_tokens


def test_echo_without_logprobs_and_max_tokens_zero_alone(server, client):
    r = client.completions.create(model="tiny-py", prompt=PROMPTS[1], echo=True, max_tokens=3, temperature=0)
    plain = client.completions.create(model="tiny-py", prompt=PROMPTS[1], max_tokens=3, temperature=0)
    assert r.choices[0].text == PROMPTS[1] + plain.choices[0].text and r.choices[0].logprobs is None
    empty = client.completions.create(model="tiny-py", prompt=PROMPTS[1], max_tokens=0, logprobs=2)
    assert empty.choices[0].text == "" and empty.choices[0].finish_reason == "length"
    assert empty.usage.completion_tokens == 0 and empty.choices[0].logprobs is None
    ids = [5, 300, 301, 302]                                        # token ids: echoed as their text
    r = client.completions.create(model="tiny-py", prompt=ids, echo=True, max_tokens=0)
    assert r.choices[0].text == post(server, "/detokenize", {"tokens": ids}).json()["prompt"]


@pytest.mark.parametrize("max_tokens", [0, 4])
def test_streamed_echo_concatenates_to_the_whole_answer(server, max_tokens):
    body = {"model": "tiny-py", "prompt": PROMPTS[0], "echo": True, "logprobs": 2, "max_tokens": max_tokens,
            "temperature": 0}
    whole = post(server, "/v1/completions", body).json()["choices"][0]
    text, lp, first = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}, None
    with httpx.stream("POST", server.base + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                c = json.loads(line[6:])["choices"][0]
                first = c if first is None else first
                text += c["text"]
                for key in lp:
                    lp[key] += (c["logprobs"] or {}).get(key, [])
    assert first["text"].startswith(PROMPTS[0]) and first["logprobs"]["token_logprobs"][0] is None
    assert text == whole["text"] and lp == whole["logprobs"]


def test_batched_prompts_with_echo_and_n(server, client, llm):
    """Two prompts (text, then token ids) x n=2: choice i*n + j echoes prompt i, each as the same
    prompt asked alone."""
    ids = llm.engine.tokenizer.encode(PROMPTS[1]).ids
    for prompt in ([PROMPTS[0], PROMPTS[1]], [llm.engine.tokenizer.encode(PROMPTS[0]).ids, ids]):
        r = client.completions.create(model="tiny-py", prompt=prompt, echo=True, logprobs=1, max_tokens=2, n=2,
                                      temperature=0).model_dump()
        assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
        for i, c in enumerate(r["choices"]):
            check_echo(llm, c, PROMPTS[i // 2], 1, 2)
        assert r["usage"]["prompt_tokens"] == len(llm.engine.tokenizer.encode(PROMPTS[0]).ids) + len(ids)
    assert idle(server), server.metrics()


def check_vllm_prompt_logprobs(llm, got, ids, k):
    """vLLM's shape: [None, {"id": {logprob, rank, decoded_token}}, ...], the prompt token with
    its rank and the top k ranked 1..k, logprobs equal to the offline engine's."""
    want = offline(llm, {"prompt_token_ids": ids}, k)
    assert len(got) == len(ids) and got[0] is None
    for p in range(1, len(ids)):
        entry, chosen = got[p], got[p][str(ids[p])]
        top = sorted(want.prompt_logprobs[p].items(), key=lambda kv: -kv[1])[:k]
        assert set(entry) == {str(ids[p])} | {str(t) for t, _ in top}
        assert abs(chosen["logprob"] - want.prompt_logprobs[p][ids[p]]) < TOL
        assert chosen["decoded_token"] == llm.engine.tokenizer.decode([ids[p]], skip_special_tokens=False)
        for r, (t, v) in enumerate(top, 1):
            assert abs(entry[str(t)]["logprob"] - v) < TOL and entry[str(t)]["rank"] == r
        better = [t for t, v in want.prompt_logprobs[p].items() if v > want.prompt_logprobs[p][ids[p]] + TOL]
        assert chosen["rank"] >= 1 + len(better) and (chosen["rank"] > k or str(ids[p]) in {str(t) for t, _ in top})


def test_vllm_prompt_logprobs_on_completions_and_chat(server, llm):
    r = post(server, "/v1/completions", {"model": "tiny-py", "prompt": PROMPTS, "prompt_logprobs": 2,
                                         "max_tokens": 1, "temperature": 0}).json()
    for c, prompt in zip(r["choices"], PROMPTS):
        check_vllm_prompt_logprobs(llm, c["prompt_logprobs"], llm.engine.tokenizer.encode(prompt).ids, 2)
    assert "prompt_logprobs" not in post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1}).json()["choices"][0]
    msgs = [{"role": "user", "content": "Write a loop."}]
    chat = post(server, "/v1/chat/completions", {"model": "tiny-py", "messages": msgs, "prompt_logprobs": 1,
                                                  "max_tokens": 2, "n": 2, "temperature": 0}).json()
    ids = post(server, "/tokenize", {"messages": msgs}).json()["tokens"]
    check_vllm_prompt_logprobs(llm, chat["prompt_logprobs"], ids, 1)      # vLLM's place: the top of a chat
    assert all("prompt_logprobs" not in c for c in chat["choices"])
    streamed = post(server, "/v1/chat/completions", {"messages": msgs, "prompt_logprobs": 0, "stream": True})
    assert streamed.status_code == 400 and "prompt_logprobs" in streamed.json()["message"]
    assert idle(server), server.metrics()


def test_tokenizer_info_is_what_lm_eval_reads(server, llm):
    info = httpx.get(server.base + "/tokenizer_info").json()
    assert info["eos_token"] == "<|endoftext|>" and "bos_token" in info and info["tokenizer_class"]
    assert info["chat_template"].startswith("{%- macro visible_text")
    assert not {"vocab_file", "merges_file", "tokenizer_file"} & set(info)
    # lm-eval's RemoteTokenizer: eos_token_id is /tokenize of eos_token without special tokens added
    tok = post(server, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert tok == [llm.engine.tokenizer.token_to_id("<|endoftext|>")]
    assert post(server, "/detokenize", {"tokens": tok}).json()["prompt"] == info["eos_token"]


UNIMPLEMENTED = {"best_of": (1, 3), "min_tokens": (0, 2), "repetition_penalty": (1.0, 1.2),
                 "truncate_prompt_tokens": (None, 5), "logit_bias": ({}, {"5": 1.0}), "presence_penalty": (0, 0.5)}


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_one_rule_for_fields(server, route):
    """An undeclared field and a declared-but-unimplemented one at a value that asks for something
    are both a 400 naming the field; the latter at its no-op value is served. The schema says so."""
    base = {"prompt": "x"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    base["max_tokens"] = 1
    for field, (noop, asks) in UNIMPLEMENTED.items():
        ok = post(server, route, {**base, field: noop})
        assert ok.status_code == 200, (field, ok.text)
        bad = post(server, route, {**base, field: asks})
        assert bad.status_code == 400 and field in bad.json()["message"], (field, bad.text)
    for extra in ({"made_up": 1}, {"skip_special_tokens": False}, {"stream_options": {"include_usage": True, "x": 1}}):
        bad = post(server, route, {**base, **extra})
        assert bad.status_code == 400 and "unknown field" in bad.json()["message"], bad.text
    if route == "/v1/completions":
        assert post(server, route, {**base, "suffix": "tail"}).status_code == 400
    else:
        assert post(server, route, {**base, "echo": True}).status_code == 400     # vLLM's chat echo: not ouro's
    spec = httpx.get(server.base + "/openapi.json").json()["components"]["schemas"]
    for schema in ("CompletionRequest", "ChatCompletionRequest"):
        assert spec[schema]["additionalProperties"] is False and "prompt_logprobs" in spec[schema]["properties"]


@pytest.mark.parametrize("route,body,schema", [
    ("/v1/responses", {"input": "x", "max_output_tokens": 1}, "ResponsesRequest"),
    ("/tokenize", {"prompt": "x"}, "TokenizeRequest"), ("/detokenize", {"tokens": [5]}, "DetokenizeRequest")])
def test_the_other_routes_keep_the_same_rule(server, route, body, schema):
    assert post(server, route, body).status_code == 200
    bad = post(server, route, {**body, "made_up": 1})
    assert bad.status_code == 400 and "made_up: unknown field" in bad.json()["message"], bad.text
    spec = httpx.get(server.base + "/openapi.json").json()["components"]["schemas"]
    assert spec[schema]["additionalProperties"] is False


def test_unknown_model_is_vllms_404(server, client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-5", prompt="x", max_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "x"}], max_tokens=1)
    r = post(server, "/tokenize", {"model": "gpt-5", "prompt": "x"})
    assert r.status_code == 404 and r.json()["type"] == "NotFoundError"


def test_a_form_encoded_body_is_told_to_send_json(server):
    """`curl -d` without -H sends application/x-www-form-urlencoded: never read as JSON (a web page
    could send that cross-site without asking); the 400 says what to add."""
    raw = b'{"prompt": "x", "max_tokens": 1}'
    for headers in ({"content-type": "application/x-www-form-urlencoded"}, {}):
        r = httpx.post(server.base + "/v1/completions", content=raw, headers=headers)
        assert r.status_code == 400 and "content-type: application/json" in r.json()["message"], r.text
    assert httpx.post(server.base + "/v1/completions", content=raw,
                      headers={"content-type": "application/json"}).status_code == 200
    assert idle(server), server.metrics()
