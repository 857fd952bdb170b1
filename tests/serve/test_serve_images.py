"""Image chat through a real `ouro serve` on `tiny-vl`: the official `openai` client's image_url
parts give the tokens of offline generation with the same image; every limit is a 400 with the
OpenAI error body before any work, and nothing is left behind."""

from __future__ import annotations


import openai
import pytest

from ouro.models.resolve import resolve_model
from tests.helpers.image_helpers import data_uri, offline_tokens, png
from tests.helpers.serve_helpers import Server, idle, post

pytestmark = pytest.mark.processes


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    (d / "local.png").write_bytes(png(50, 60, seed=5))
    return d


@pytest.fixture(scope="module")
def server(media, tmp_path_factory):
    s = Server(resolve_model("tiny-vl"), "--allowed-local-media-path", str(media), "--limit-mm-per-prompt",
               '{"image": 2}', "--max-image-pixels", "200000", tmp_path=tmp_path_factory.mktemp("logs"))
    yield s
    s.stop()


def test_image_chat_equals_offline_generation(server, media):
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0)
    a, b = png(40, 70, seed=1), (media / "local.png").read_bytes()
    content = [{"type": "text", "text": "compare"}, {"type": "image_url", "image_url": {"url": data_uri(a)}},
               {"type": "image_url", "image_url": {"url": f"file://{media / 'local.png'}"}}]
    r = client.chat.completions.create(model=None, messages=[{"role": "user", "content": content}], max_tokens=6,
                                       temperature=0, logprobs=True,
                                       extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    got = [int(e.token.removeprefix("token_id:")) for e in r.choices[0].logprobs.content]
    rendered = [{"role": "user", "content": [{"type": "text", "text": "compare"}, {"type": "image"}, {"type": "image"}]}]
    assert got == offline_tokens(rendered, [a, b], 6)
    assert r.usage.prompt_tokens > 16 * 2            # the image tokens count as prompt tokens
    assert idle(server)


@pytest.mark.parametrize("part, status, says", [
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, 400, "network"),
    ({"type": "image_url", "image_url": {"url": "file:///etc/hostname"}}, 400, "outside --allowed-local-media-path"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, 400, "base64"),
    ({"type": "image_url", "image_url": {"url": data_uri(b"not an image at all")}}, 400, "not a readable image"),
    ({"type": "image_url", "image_url": {"url": data_uri(png(500, 500, seed=2))}}, 400, "pixels"),
    ({"type": "image_url"}, 400, "image_url.url"),
    ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}, 400, "video input is not supported"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, 400, "'input_audio' are not supported"),
    ({"type": "file", "file": {"file_data": "data:application/pdf;base64,AAAA"}}, 400, "'file' are not supported"),
    ({"type": "banana"}, 400, "'banana' are not supported"),
], ids=["http", "outside", "bad base64", "not an image", "too many pixels", "no url", "video", "audio", "file",
        "unknown"])
def test_bad_images_are_400s_that_cost_nothing(server, part, status, says):
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}], "max_tokens": 2}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == status and says in r.json()["message"], r.text
    assert r.json()["object"] == "error" and r.json()["type"] == "BadRequestError"
    assert idle(server)


def test_too_many_images(server):
    img = {"type": "image_url", "image_url": {"url": data_uri(png(30, 30, seed=3))}}
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": [img] * 3}], "max_tokens": 2})
    assert r.status_code == 400 and "more than 2 images" in r.json()["message"]
    assert idle(server)
