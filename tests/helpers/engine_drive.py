"""Driving an engine in the tests: step it until idle, the budget that buys a number of pages and
state slots, whether its pools are full again, and transformers' own greedy continuation."""

import torch

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


def budget_for(config, pages, slots, page_size=16):
    """The memory budget that buys exactly `pages` pages and `slots` KDA state slots."""
    return pages * page_size * ModelCache.bytes_per_token(config) + slots * ModelCache.bytes_per_slot(config)


def pools_full(engine):
    return engine.pages.num_free == engine.pages.num_total and engine.slots.num_free == engine.plan.n_slots


def drive(engine, limit=10_000):
    """Step until idle; returns {request_id: final RequestOutput}."""
    done = {}
    for _ in range(limit):
        if not engine.has_unfinished():
            return done
        done.update({o.request_id: o for o in engine.step() if o.finished})
    raise AssertionError("engine did not drain")
