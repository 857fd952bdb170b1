"""`ouro serve --disagg 1E1P1D` on `tiny-vl`, real processes on 127.0.0.1: text and image chats
sent together through the official `openai` client (one image, two back to back, the same image
twice) get the tokens offline generation gives; the encode worker is used for images only; a
repeated image is served from the prefill worker's encoder cache; everything is released."""

from __future__ import annotations

import concurrent.futures as cf
import time

import openai
import pytest

from ouro.models.resolve import resolve_model

from tests.helpers.image_helpers import data_uri, offline_tokens, png
from tests.helpers.serve_helpers import Server, idle

pytestmark = pytest.mark.processes

N_TOKENS = 6


def requests():
    a, b, c = png(40, 70, seed=11), png(28, 56, seed=12), png(60, 30, seed=13)
    img = lambda raw: {"type": "image_url", "image_url": {"url": data_uri(raw)}}
    return [("text", [{"role": "user", "content": "hello there"}], []),
            ("one", [{"role": "user", "content": [{"type": "text", "text": "what is it"}, img(a)]}], [a]),
            ("back to back", [{"role": "user", "content": [img(b), img(c), {"type": "text", "text": "and?"}]}], [b, c]),
            ("text 2", [{"role": "user", "content": "a longer text prompt " * 6}], []),
            ("again", [{"role": "user", "content": [{"type": "text", "text": "what is it"}, img(a)]}], [a])]


def rendered(messages):
    """The messages as the offline reference takes them: image parts as {"type": "image"}."""
    out = []
    for m in messages:
        c = m["content"]
        out.append({**m, "content": c if isinstance(c, str) else
                    [{"type": "image"} if p["type"] == "image_url" else p for p in c]})
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(resolve_model("tiny-vl"), "--disagg", "1E1P1D", "--dtype", "float32",
               tmp_path=tmp_path_factory.mktemp("epd"))
    yield s
    s.stop()


def chat(server, messages):
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model=None, messages=messages, max_tokens=N_TOKENS, temperature=0,
                                       logprobs=True, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    return [int(e.token.removeprefix("token_id:")) for e in r.choices[0].logprobs.content]


def metric(server, name, want=None, timeout=10):
    """A gauge's value; with `want`, once it shows that (the workers' heartbeats trail the replies)."""
    deadline = time.monotonic() + timeout
    while True:
        v = next(v for k, v in server.metrics().items() if k.split("{")[0] == name)
        if want is None or v == want or time.monotonic() > deadline:
            return v
        time.sleep(0.2)


def lookups(server, n, timeout=10) -> tuple[float, float]:
    """The prefill worker's encoder-cache (hits, misses), once they add up to `n` lookups (the
    workers' heartbeats trail the replies)."""
    deadline = time.monotonic() + timeout
    while True:
        hits, misses = metric(server, "ouro:epd_encoder_cache_hits"), metric(server, "ouro:epd_encoder_cache_misses")
        if hits + misses >= n or time.monotonic() > deadline:
            return hits, misses
        time.sleep(0.2)


def test_1e1p1d_answers_text_and_image_chats_as_offline_generation(server):
    reqs = requests()
    want = {name: offline_tokens(rendered(msgs), images, N_TOKENS) for name, msgs, images in reqs}
    with cf.ThreadPoolExecutor(4) as pool:
        got = dict(zip([n for n, _, _ in reqs[:4]], pool.map(lambda r: chat(server, r[1]), reqs[:4])))
    got["again"] = chat(server, reqs[4][1])              # after "one": its image's rows are on the prefill side
    assert got == want
    assert metric(server, "ouro:epd_images_encoded", 3) == 3       # a, b, c once each: "again" was not re-encoded
    # four lookups (one, back to back (2), again): each finds its rows in the cache or held on arrival
    # (a hit), or, where the request reached the prefill worker before the rows being encoded for
    # it, misses and waits for them without asking again (the order is the machine's: under load
    # the requests often come first); "again" follows "one", whose rows are cached: a hit
    hits, misses = lookups(server, 4)
    assert hits + misses == 4 and hits >= 1, (hits, misses)
    assert metric(server, "ouro:epd_encoders_up") == 1
    assert idle(server) and metric(server, "ouro:epd_image_waits", 0) == 0
    assert metric(server, "ouro:pd_prefill_pages_used", 0) == 0 and metric(server, "ouro:pd_decode_rooms", 0) == 0


def test_bench_serve_sends_image_chats(server):
    """`ouro bench serve --image-size`'s load: chat requests with new images, streamed, all served."""
    import asyncio

    from ouro.bench.load_gen import make_image_prompts, run_load
    prompts = make_image_prompts(3, 8, (300, 400), seed=0, size=(56, 84), per_request=2)
    before = metric(server, "ouro:epd_images_encoded")      # what other tests on this server encoded (any order)
    records, _ = asyncio.run(run_load(server.base, "/v1/chat/completions", None, prompts, 4, float("inf"), 2, 0,
                                      progress=False))
    assert all(r.success and r.ttft > 0 and r.output_tokens == 4 for r in records), [r.error for r in records]
    assert all(r.prompt_tokens > 2 * 16 for r in records)      # the images' tokens are in the prompt
    # 2 new images per request; the untimed warm-up request is prompt 0, whose images the timed one finds cached
    assert metric(server, "ouro:epd_images_encoded", before + 6) == before + 6


@pytest.mark.slow       # a recovery path of 1E1P1D, whose main path runs by default above
def test_a_prefill_worker_that_cached_nothing_asks_again_and_answers(tmp_path):
    """--encoder-cache-mb 0: the router believes the prefill worker holds a repeated image's rows,
    it does not; it asks (need_images), the image is encoded again, and the reply is right."""
    s = Server(resolve_model("tiny-vl"), "--disagg", "1E1P1D", "--dtype", "float32", "--encoder-cache-mb", "0",
               tmp_path=tmp_path)
    try:
        name, msgs, images = requests()[1]
        want = offline_tokens(rendered(msgs), images, N_TOKENS)
        assert chat(s, msgs) == want and chat(s, msgs) == want
        assert metric(s, "ouro:epd_images_encoded", 2) == 2          # the second time, encoded again on the ask
        # the first time the rows came with the request (held apart from the cache, a hit, or, when the
        # request came first, a miss that waits for them); the second a miss, asked for again
        hits, misses = lookups(s, 2)
        assert hits + misses == 2 and misses >= 1, (hits, misses)
        assert idle(s) and metric(s, "ouro:epd_image_waits", 0) == 0
    finally:
        s.stop()
