"""The engine under mixed load against transformers run one request at a time."""

import random

import pytest
import torch

from hf_reference import rel_rms
from ouro.config import EngineConfig
from ouro.engine.llm_engine import LLMEngine
from ouro.engine.sampling import SamplingParams
from ouro.layers.context import ModelCache


def hf_greedy(hf, prompt, n):
    """Greedy continuation and per-step logits from transformers with its own cache."""
    logits, toks = [], []
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            logits.append(out.logits[0, -1])
            toks.append(int(out.logits[0, -1].argmax()))
            out = hf(torch.tensor([[toks[-1]]]), cache=out.cache, use_cache=True)
    return toks, logits


def make_engine(model, max_memory, **kw):
    cfg = EngineConfig(page_size=16, max_memory=max_memory, max_num_seqs=kw.pop("max_num_seqs", 8),
                       max_num_batched_tokens=kw.pop("max_num_batched_tokens", 48))
    return LLMEngine(model, None, cfg, verbose=False, record_logits=True, **kw)


def budget_for(config, pages, slots, page_size=16):
    """The memory budget that buys exactly `pages` pages and `slots` KDA state slots."""
    return pages * page_size * ModelCache.bytes_per_token(config) + slots * ModelCache.bytes_per_slot(config)


def pools_full(engine):
    return engine.pages.num_free == engine.pages.num_total and engine.slots.num_free == engine.plan.n_slots


@pytest.mark.parametrize("shape", ["tiny", "shared"])
def test_mixed_run_matches_transformers(hf_pair, shape):
    """Different prompt lengths, arrivals while others decode, chunked prefill (48-token budget)
    and preemption (a page budget too small for everyone) -- every request's greedy tokens and
    per-step logits equal transformers' for the request alone."""
    _, hf, model = hf_pair(shape)
    rng = random.Random(0)
    V = model.config.vocab_size
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (5, 40, 77, 120, 33, 61)]
    engine = make_engine(model, max_memory=budget_for(model.config, pages=14, slots=8))
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    ids, steps, finished = [], 0, {}
    while len(ids) < len(prompts) or engine.has_unfinished():
        if len(ids) < len(prompts) and steps % 3 == 0:   # arrivals interleaved with decoding
            ids.append(engine.add_request({"prompt_token_ids": prompts[len(ids)]}, params))
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        steps += 1
    assert engine.scheduler.num_preemptions > 0, "the page budget was meant to force preemption"
    for rid, prompt in zip(ids, prompts):
        toks, ref = hf_greedy(hf, prompt, 14)
        got = finished[rid]
        assert got.token_ids == toks
        assert rel_rms(torch.stack(engine.logits_history[rid]), torch.stack(ref)) <= 1e-4
    assert pools_full(engine)


def test_oversized_requests_are_rejected(hf_pair):
    _, _, model = hf_pair("tiny")
    engine = make_engine(model, max_memory=400_000)
    with pytest.raises(ValueError, match="context length"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=model.config.max_position_embeddings))
    with pytest.raises(ValueError, match="total capacity"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=engine.plan.max_tokens))
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.add_request("text needs a tokenizer")
    assert not engine.has_unfinished() and pools_full(engine)
