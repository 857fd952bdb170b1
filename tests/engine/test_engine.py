"""The engine under mixed load against transformers run one request at a time."""

import random

import pytest
import torch

from tests.helpers.engine_drive import budget_for, drive, hf_greedy, pools_full
from tests.helpers.numerics import rel_rms
from ouro.config import EngineConfig
from ouro.engine.llm_engine import LLMEngine
from ouro.engine.sampling import SamplingParams
from ouro.layers.context import ModelCache


def make_engine(model, max_memory, **kw):
    cfg = EngineConfig(page_size=16, max_memory=max_memory, max_num_seqs=kw.pop("max_num_seqs", 8),
                       max_num_batched_tokens=kw.pop("max_num_batched_tokens", 48))
    return LLMEngine(model, None, cfg, verbose=False, record_logits=True, **kw)


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


def state_of(engine, rid):
    req = next((r for r in [*engine.scheduler.running, *engine.scheduler.waiting] if r.request_id == rid), None)
    return None if req is None else req.status.value


@pytest.mark.parametrize("when", ["waiting", "mid-prefill", "mid-decode", "preempted"])
def test_abort_in_every_state_frees_everything(hf_pair, when):
    _, _, model = hf_pair("tiny")
    engine = make_engine(model, max_memory=budget_for(model.config, pages=12, slots=4), max_num_seqs=4,
                         max_num_batched_tokens=32)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    if when == "waiting":
        rid = engine.add_request(list(range(50)), greedy)
        assert state_of(engine, rid) == "waiting"
    elif when == "mid-prefill":
        rid = engine.add_request(list(range(100)), greedy)  # 100 tokens at 32 a step
        engine.step()
        req = engine.requests[rid]
        assert req.status.value == "running" and 0 < req.num_computed < 100
    elif when == "mid-decode":
        rid = engine.add_request(list(range(20)), greedy)
        for _ in range(4):
            engine.step()
        assert engine.requests[rid].output_ids
    else:
        # two long requests on 12 pages: the later one is preempted when the earlier grows
        first = engine.add_request(list(range(90)), greedy)
        rid = engine.add_request(list(range(1, 90)), greedy)
        for _ in range(200):
            engine.step()
            if state_of(engine, rid) == "preempted":
                break
        assert state_of(engine, rid) == "preempted"
        engine.abort(first)
    assert engine.abort(rid)
    assert not engine.abort(rid)  # a second abort is a no-op
    drive(engine)
    assert pools_full(engine)


def test_randomized_run_with_aborts_ends_with_full_pools(hf_pair):
    """300 requests of random sizes arrive over time; a third are aborted at random moments."""
    _, _, model = hf_pair("tiny")
    engine = make_engine(model, max_memory=budget_for(model.config, pages=40, slots=6), max_num_seqs=6,
                         max_num_batched_tokens=64)
    rng = random.Random(1)
    live, submitted, finished = [], 0, 0
    while submitted < 300 or engine.has_unfinished():
        for _ in range(rng.randrange(0, 4)):
            if submitted < 300:
                prompt = [rng.randrange(512) for _ in range(rng.randrange(1, 60))]
                p = SamplingParams(temperature=rng.choice([0, 0.8]), max_tokens=rng.randrange(1, 12), seed=submitted)
                live.append(engine.add_request(prompt, p))
                submitted += 1
        if live and rng.random() < 0.3:
            engine.abort(live.pop(rng.randrange(len(live))))
        for out in engine.step():
            if out.finished:
                finished += 1
                live.remove(out.request_id)
                assert out.finish_reason == "length" and len(out.token_ids) >= 1
    assert finished > 100 and not engine.requests
    assert pools_full(engine)


def test_seeded_sampling_is_batch_independent(hf_pair):
    _, _, model = hf_pair("tiny")
    p = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    alone = make_engine(model, max_memory=budget_for(model.config, pages=40, slots=8))
    rid = alone.add_request(list(range(30)), p)
    want = drive(alone)[rid].token_ids
    busy = make_engine(model, max_memory=budget_for(model.config, pages=40, slots=8))
    others = [busy.add_request(list(range(i, i + 20)), SamplingParams(temperature=1.0, seed=i, max_tokens=20,
                                                                       ignore_eos=True)) for i in range(4)]
    busy.step()
    rid = busy.add_request(list(range(30)), p)  # joins mid-run, shares batches with the others
    got = drive(busy)
    assert got[rid].token_ids == want
    assert len({tuple(got[o].token_ids) for o in others}) == 4


def test_state_slots_limit_is_reported(hf_pair, caplog):
    """Plenty of pages but two state slots: the third request waits, and the engine says why."""
    _, _, model = hf_pair("tiny")
    # half of the budget holds two slots (the planner's cap), the other half several pages
    engine = make_engine(model, max_memory=5 * ModelCache.bytes_per_slot(model.config), max_num_seqs=8)
    assert engine.plan.n_slots == 2 and engine.plan.n_pages >= 3 and engine.plan.limit(16) == "state slots"
    for i in range(3):
        engine.add_request(list(range(i, i + 10)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    with caplog.at_level("WARNING", logger="ouro.scheduler"):
        engine.step()
    st = engine.stats()
    assert st["running"] == 2 and st["waiting"] == 1 and st["slot_limited_steps"] >= 1
    assert "KDA state slots" in caplog.text
    drive(engine)
    assert pools_full(engine)


def test_bfloat16_engine_runs_close_to_float32(hf_pair, tmp_path):
    """The CUDA default dtype, exercised on the CPU: bf16 weights and caches, fp32 KDA states."""
    from ouro.models.loader import load_model
    d, _, model = hf_pair("tiny")
    bf16 = load_model(d, dtype=torch.bfloat16)
    prompt = list(range(60))
    outs = []
    for m in (model, bf16):
        engine = make_engine(m, max_memory=budget_for(m.config, pages=20, slots=2))
        rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        drive(engine)
        outs.append(engine.logits_history[rid][0])
        assert engine.runner.cache.recurrent.dtype == torch.float32
    assert engine.runner.cache.latent.dtype == torch.bfloat16
    assert rel_rms(outs[1], outs[0]) <= 5e-2
