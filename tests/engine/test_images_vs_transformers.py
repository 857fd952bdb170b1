"""A prompt with images through ouro's engine (processor, vision tower, image rows scattered into
the prompt's placeholder rows, chunked prefill, decode) against transformers' full glm5_next
model on the same pixels, on `tiny-vl` (every tower weight random). Also: the prefix cache tells
two different images behind the same placeholder ids apart, and reuses an identical one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.image_helpers import rows_one_position_late
from tests.helpers.numerics import rel_rms
from ouro.config import EngineConfig, ModelConfig
from ouro.engine.llm_engine import LLMEngine
from ouro.engine.sampling import SamplingParams
from ouro.models.image_processor import ImageProcessor, expand_placeholders
from ouro.models.loader import load_model
from ouro.models.resolve import load_tokenizer, resolve_model

TOL = 1e-4


def picture(h: int, w: int, seed: int):
    from PIL import Image
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def vl():
    d = resolve_model("tiny-vl")
    from transformers import Glm5NextForConditionalGeneration
    hf = Glm5NextForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    return d, hf, ModelConfig.from_hf(d)


def engine(d, prefix=False, **kw):
    cfg = EngineConfig(**{"max_memory": 64 << 20, "page_size": 16, "max_num_batched_tokens": 16,
                          "enable_prefix_caching": prefix, **kw})
    return LLMEngine(load_model(d), load_tokenizer(d), cfg, verbose=False, record_logits=True, model_dir=d)


def placeholder(c):
    return [c.image_start_token_id, c.image_token_id, c.image_end_token_id]


def run(eng, ids, images, steps=4, prompt_logprobs=True):
    rid = eng.add_request({"prompt_token_ids": ids, "multi_modal_data": {"image": images}},
                          SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True,
                                         prompt_logprobs=0 if prompt_logprobs else None))
    out = None
    while eng.has_unfinished():
        for o in eng.step():
            if o.request_id == rid and o.finished:
                out = o
    return rid, out


@torch.no_grad()
def hf_run(hf, ids, pixels, grid, tokens):
    """transformers' prompt logits, then its decode logits fed `tokens`."""
    out = hf(input_ids=torch.tensor([ids]), pixel_values=pixels, image_grid_thw=grid, use_cache=True)
    prefill, cache, decode = out.logits[0], out.cache, []
    for t in tokens[:-1]:
        out = hf(input_ids=torch.tensor([[t]]), cache=cache, use_cache=True)
        cache = out.cache
        decode.append(out.logits[0, -1])
    return prefill, decode


@pytest.mark.parametrize("sizes", [[(60, 90)], [(45, 70), (90, 40)]], ids=["one image", "two back to back"])
def test_image_prompt_equals_transformers(vl, sizes):
    d, hf, c = vl
    images = [picture(h, w, seed=i + 3) for i, (h, w) in enumerate(sizes)]
    ids = [5, 6, 7] + placeholder(c) * len(images) + [8, 9, 10]
    proc = ImageProcessor.from_dir(d)
    pixels, grid = proc(images)
    expanded = expand_placeholders(ids, proc.tokens_per_image(grid), c.image_token_id, c.image_start_token_id,
                                   c.image_end_token_id)
    eng = engine(d)
    rid, out = run(eng, ids, images)
    assert out.prompt_token_ids == expanded and len(expanded) > 20      # prefilled over several chunks
    prefill, decode = hf_run(hf, expanded, pixels, grid, out.token_ids)
    # every prompt position: the logprob of the next prompt token, as transformers has it
    ours = torch.tensor([e[expanded[p + 1]] for p, e in enumerate(out.prompt_logprobs[1:])])
    ref = prefill[:-1].log_softmax(-1).gather(-1, torch.tensor(expanded[1:])[:, None])[:, 0]
    assert not torch.isnan(ours).any() and rel_rms(ours, ref) < TOL
    logits = eng.logits_history[rid]
    assert rel_rms(logits[0], prefill[-1]) < TOL
    for got, want in zip(logits[1:], decode):
        assert rel_rms(got, want) < TOL
    assert out.token_ids[0] == int(prefill[-1].argmax())


def test_image_rows_one_position_off_are_caught(vl, monkeypatch):
    """The planted fault: image rows scattered one position late. The comparison must fail."""
    d, hf, c = vl
    images = [picture(60, 90, seed=3)]
    ids = [5, 6, 7] + placeholder(c) + [8, 9]
    rows_one_position_late(monkeypatch)
    proc = ImageProcessor.from_dir(d)
    pixels, grid = proc(images)
    eng = engine(d, max_num_batched_tokens=2048)
    rid, out = run(eng, ids, images, steps=1)
    prefill, _ = hf_run(hf, out.prompt_token_ids, pixels, grid, out.token_ids)
    assert rel_rms(eng.logits_history[rid][0], prefill[-1]) > 100 * TOL


def test_prefix_cache_keys_images_by_their_pixels(vl):
    """Same placeholder ids, another image: no cached page is shared and the logits are a cold
    run's; the same image again: its pages are reused and the logits are the same."""
    d, _, c = vl
    a, b = picture(60, 90, seed=11), picture(60, 90, seed=12)
    ids = [5, 6, 7] + placeholder(c) + [8, 9, 10, 11]
    cold = {}
    for name, img in (("a", a), ("b", b)):
        eng = engine(d)
        rid, out = run(eng, ids, [img], steps=2)
        cold[name] = (eng.logits_history[rid][0], out.token_ids)
    eng = engine(d, prefix=True)           # chunks of a page: a KDA checkpoint at every page boundary
    run(eng, ids, [a], steps=2, prompt_logprobs=False)
    for name, img, hit in (("b", b, False), ("a", a, True)):
        rid, out = run(eng, ids, [img], steps=2, prompt_logprobs=False)
        assert (out.cached_tokens >= 16) == hit, (name, out.cached_tokens)
        assert rel_rms(eng.logits_history[rid][0], cold[name][0]) < TOL and out.token_ids == cold[name][1]
    assert rel_rms(cold["a"][0], cold["b"][0]) > 1e-3          # the two images do change the logits


@pytest.mark.processes
def test_tp2_image_prompt_equals_one_rank(vl):
    """Under --tp 2 rank 0 encodes the images and its followers get the rows with each forward."""
    from ouro.engine.llm import LLM
    d, _, c = vl
    prompt = {"prompt_token_ids": [5, 6] + placeholder(c) * 2 + [7, 8, 9],
              "multi_modal_data": {"image": [picture(60, 90, seed=21), picture(40, 40, seed=22)]}}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    one = LLM(str(d), max_memory=64 << 20, page_size=16, max_num_batched_tokens=16).generate(prompt, params)[0]
    threads = torch.get_num_threads()
    two = LLM(str(d), max_memory=64 << 20, page_size=16, max_num_batched_tokens=16, tensor_parallel_size=2)
    try:
        got = two.generate(prompt, params)[0]
    finally:
        two.engine.close()
    assert torch.get_num_threads() == threads        # a closed TP engine gives the process its threads back
    assert got.outputs[0].token_ids == one.outputs[0].token_ids and len(got.prompt_token_ids) > 20
    assert got.outputs[0].logprobs == pytest.approx(one.outputs[0].logprobs, abs=1e-4)
