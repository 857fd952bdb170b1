"""The scheduler always makes progress, and nothing leaks, under tight budgets, prefix sharing,
aborts and failing forwards."""

import random

import pytest

from ouro.config import EngineConfig
from ouro.engine.llm_engine import LLMEngine
from ouro.engine.sampling import SamplingParams
from ouro.models.glm5_next import Glm5NextModel
from ouro.models.presets import PRESETS, init_weights
from tests.helpers.engine_drive import budget_for, drive


@pytest.fixture(scope="module")
def tiny():
    model = Glm5NextModel(PRESETS["tiny"])
    init_weights(model, seed=3)
    return model.eval()


def engine(model, pages, slots=4, page_size=16, tokens=512, caching=True, interval=1):
    cfg = EngineConfig(page_size=page_size, max_memory=budget_for(model.config, pages, slots, page_size),
                       max_num_seqs=slots, max_num_batched_tokens=tokens, enable_prefix_caching=caching,
                       prefix_checkpoint_interval=interval)
    return LLMEngine(model, None, cfg, verbose=False)


def pools_full_after_reset(e):
    """Every page, slot and checkpoint is back once the prefix cache lets go of what it keeps."""
    e.reset_prefix_cache()
    ck = e.checkpointer.store
    return (e.pages.num_free == e.pages.num_total and e.slots.num_free == e.slots.num_total
            and (ck is None or len(ck.free_ids) == e.plan.n_checkpoints))


@pytest.mark.parametrize("page_size,pages", [(16, 8), (8, 12), (4, 20)])
def test_waiting_prefix_hit_cannot_starve_the_running_request(tiny, page_size, pages):
    """A cached prefix S (2 pages). A (a fresh prompt) needs every page of the cache; B (S + a
    long tail) hits S but does not fit beside A. B must not keep S's pages locked while it
    waits: A then could only preempt itself, forever."""
    e = engine(tiny, pages=pages, slots=4, page_size=page_size, caching=True)
    n, ps = e.plan.n_pages, page_size
    assert n >= 6 and e.prefix_cache is not None
    rng = random.Random(page_size)
    toks = lambda k: [rng.randrange(10, 500) for _ in range(k)]
    s = toks(2 * ps)
    e.add_request(s + [1, 2, 3], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    drive(e, limit=50)                                  # S is now cached, with a checkpoint
    assert e.prefix_cache.stats()["checkpoints_held"] >= 1
    a = e.add_request(toks(3 * ps), SamplingParams(temperature=0, max_tokens=(n - 3) * ps, ignore_eos=True))
    b = e.add_request(s + toks((n - 4) * ps), SamplingParams(temperature=0, max_tokens=min(8, ps), ignore_eos=True))
    done = drive(e, limit=(n - 3) * ps + 100)           # A alone needs (n - 3) * ps steps
    assert set(done) == {a, b} and len(done[a].token_ids) == (n - 3) * ps
    assert e.stats()["preemptions"] < 10
    assert pools_full_after_reset(e)


class FlakyForward:
    """Wraps the model: with probability p a forward raises, before running or after it has
    advanced the KDA states and written cache rows (the dangerous case)."""

    def __init__(self, model, rng, p):
        self.model, self.rng, self.p, self.raised = model, rng, p, 0

    def __call__(self, ids, ctx):
        fail = self.rng.random() < self.p
        if fail and self.rng.random() < 0.5:
            self.raised += 1
            raise RuntimeError("injected failure before the forward")
        out = self.model(ids, ctx)
        if fail:
            self.raised += 1
            raise RuntimeError("injected failure after the forward")
        return out


def run_alone(model, prompt, params, cache={}):
    key = (tuple(prompt), repr(params))
    if key not in cache:
        e = engine(model, pages=64, slots=1, caching=False)
        rid = e.add_request(prompt, params)
        cache[key] = drive(e, limit=500)[rid].token_ids
    return cache[key]


@pytest.mark.parametrize("trial", [0, 1, pytest.param(2, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow)])
def test_randomized_liveness_and_leaks(tiny, trial):
    """Random budgets, page sizes, prefix sharing, arrivals, aborts and failing forwards,
    bounded in steps: every request finishes or is aborted, every finished output equals its
    run-alone output, and all pools are full at the end."""
    rng = random.Random(100 + trial)
    page_size = rng.choice([4, 8, 16])
    pages = rng.randrange(6, 24)
    slots = rng.randrange(1, 5)
    interval = rng.choice([1, 2])
    tokens = rng.choice([interval * page_size, 32, 96])
    tokens = max(tokens, interval * page_size)
    e = engine(tiny, pages, slots, page_size, tokens, caching=rng.random() < 0.8, interval=interval)
    flaky = FlakyForward(tiny, rng, p=0.08)
    e.runner.model = flaky
    cap = e.plan.max_tokens
    prefixes = [[rng.randrange(10, 500) for _ in range(rng.randrange(page_size, 3 * page_size))] for _ in range(3)]
    want, live, done, aborted = {}, [], {}, set()
    for step in range(3000):
        if len(want) < 24 and rng.random() < 0.4:
            max_tokens = rng.randrange(1, 12)
            head = rng.choice(prefixes + [[]])
            # some requests nearly fill the cache alone: they need pages others hold
            tail = rng.randrange(1, 20) if rng.random() < 0.7 else max(1, rng.randrange(cap // 2, cap + 1)
                                                                          - len(head) - max_tokens)
            prompt = head + [rng.randrange(10, 500) for _ in range(tail)]
            params = SamplingParams(temperature=rng.choice([0, 0.9]), seed=rng.randrange(1000),
                                    max_tokens=max_tokens, ignore_eos=True)
            if len(prompt) + params.max_tokens > cap:
                with pytest.raises(ValueError, match="capacity"):
                    e.add_request(prompt, params)
                continue
            rid = e.add_request(prompt, params)
            want[rid] = (prompt, params)
            live.append(rid)
        if live and rng.random() < 0.05:
            rid = live.pop(rng.randrange(len(live)))
            assert e.abort(rid)
            aborted.add(rid)
        try:
            outs = e.step()
        except RuntimeError as err:
            assert "injected" in str(err)
            continue
        for o in outs:
            if o.finished:
                done[o.request_id] = o
                live.remove(o.request_id)
        if len(want) >= 24 and not e.has_unfinished():
            break
    assert not e.has_unfinished(), f"not drained after {step + 1} steps: {e.stats()}"
    assert set(done) | aborted == set(want) and not set(done) & aborted
    assert flaky.raised > 0, "the run was meant to inject failures"
    e.runner.model = tiny
    for rid, out in done.items():
        assert out.token_ids == run_alone(tiny, *want[rid]), rid
    assert pools_full_after_reset(e)
