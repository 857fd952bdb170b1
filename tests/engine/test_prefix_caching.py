"""Prefix caching in the engine: a hit resumes from a KDA checkpoint and gives cold-run logits."""

import pytest
import torch

from tests.helpers.numerics import rel_rms
from ouro.config import EngineConfig
from ouro.engine.llm_engine import LLMEngine
from ouro.engine.sampling import SamplingParams
from tests.helpers.engine_drive import budget_for, drive, pools_full

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def engine_for(model, caching, interval=1):
    cfg = EngineConfig(page_size=16, max_memory=budget_for(model.config, pages=60, slots=4) * 2, max_num_seqs=4,
                       max_num_batched_tokens=48, enable_prefix_caching=caching, prefix_checkpoint_interval=interval)
    return LLMEngine(model, None, cfg, verbose=False, record_logits=True)


def run_one(engine, prompt):
    rid = engine.add_request(prompt, GREEDY)
    out = drive(engine)[rid]
    return out, torch.stack(engine.logits_history.pop(rid))


@pytest.mark.parametrize("shape", ["tiny", "shared"])
@pytest.mark.parametrize("interval,shared_len,expect_cached", [
    (1, 50, 48),   # KV hit of 3 pages, checkpoints every page: resume at 48
    (2, 50, 32),   # checkpoints every 2 pages: the 48-token KV hit is clamped to the checkpoint at 32
    (2, 64, 64),   # the shared part ends exactly on a checkpoint
])
def test_hit_equals_cold_run(hf_pair, shape, interval, shared_len, expect_cached):
    _, _, model = hf_pair(shape)
    g = torch.Generator().manual_seed(interval * 100 + shared_len)
    system = torch.randint(0, model.config.vocab_size, (shared_len,), generator=g).tolist()
    q1, q2 = (torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (9, 23))
    warm = engine_for(model, caching=True, interval=interval)
    first, _ = run_one(warm, system + q1)
    assert first.cached_tokens == 0
    hit, hit_logits = run_one(warm, system + q2)
    assert hit.cached_tokens == expect_cached
    cold, cold_logits = run_one(engine_for(model, caching=False), system + q2)
    assert hit.token_ids == cold.token_ids
    assert rel_rms(hit_logits, cold_logits) <= 1e-5
    stats = warm.prefix_cache.stats()
    assert stats["hits"] >= 1 and stats["cached_tokens_served"] == expect_cached
    # nothing leaks: evicting the tree returns every page; all checkpoints come back
    warm.prefix_cache.evict_pages(10 ** 6)
    assert pools_full(warm)
    assert len(warm.checkpointer.store.free_ids) == warm.plan.n_checkpoints


def test_identical_prompt_leaves_one_token_to_compute(hf_pair):
    _, _, model = hf_pair("tiny")
    engine = engine_for(model, caching=True)
    prompt = list(range(64))            # page-aligned
    a, la = run_one(engine, prompt)
    b, lb = run_one(engine, prompt)
    assert b.cached_tokens == 48        # the last page is recomputed so the last token has logits
    assert a.token_ids == b.token_ids and rel_rms(lb, la) <= 1e-5
