"""A prefill engine and a decode engine in one process, and one engine alone on the same prompts
(`disagg/test_disagg_engines.py`, `engine/test_kv_cache_quant.py`)."""

import time

import torch

from ouro.config import EngineConfig
from ouro.disagg.decode_engine import DecodeEngine
from ouro.disagg.prefill_engine import PrefillEngine
from ouro.engine.llm_engine import LLMEngine
from ouro.engine.sampling import SamplingParams
from ouro.models.loader import load_model


LENGTHS = (5, 37, 130, 64, 19)


KW = dict(max_memory=48 << 20, page_size=16, dtype="float32", max_num_batched_tokens=96)


def prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(1, 500, (n,), generator=g).tolist() for n in LENGTHS]


def params(i, sampled):
    if sampled:
        return SamplingParams(max_tokens=7, temperature=0.9, top_p=0.95, seed=100 + i)
    return SamplingParams(max_tokens=7, temperature=0.0)


def single(ckpt, sampled, kw=KW):
    e = LLMEngine(load_model(ckpt), None, EngineConfig(**kw), verbose=False)
    for i, p in enumerate(prompts()):
        e.add_request({"prompt_token_ids": p}, params(i, sampled), f"r{i}")
    out = {}
    while e.has_unfinished():
        for o in e.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def pair(ckpt, backend="tcp", timeout_s=30.0, kw=KW):
    p = PrefillEngine(LLMEngine(load_model(ckpt), None, EngineConfig(**kw), verbose=False))
    d = DecodeEngine(LLMEngine(load_model(ckpt), None, EngineConfig(**kw), verbose=False), backend, timeout_s=timeout_s)
    return p, d


def run_pair(p, d, limit_s=60):
    out = {}
    t = time.monotonic()
    while (p.has_work() or d.has_work()) and time.monotonic() - t < limit_s:
        p.step()
        for o in d.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        time.sleep(0.001)
    return out


def full(engine):
    return engine.pages.num_free == engine.pages.num_total and engine.slots.num_free == engine.slots.num_total
