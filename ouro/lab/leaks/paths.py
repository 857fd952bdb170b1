"""The request paths the leaks probe drives through the engine: each leaves the engine idle, and
between them every page, KDA slot, checkpoint and request record should be back."""

from __future__ import annotations

import torch


def make_engine(model_dir: str, prefix: bool):
    from ...config import EngineConfig
    from ...engine.llm_engine import LLMEngine
    from ...models.loader import load_model
    model = load_model(model_dir, dtype=torch.float32)
    cfg = EngineConfig(page_size=16, max_num_seqs=4, max_num_batched_tokens=24, max_memory=8 << 20,
                       enable_prefix_caching=prefix)
    return LLMEngine(model, None, cfg, verbose=False)


def _params(max_tokens=6, **kw):
    from ...engine.sampling import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _run_until(engine, rid, cond, limit=200):
    for _ in range(limit):
        req = engine.requests.get(rid)
        if req is None or cond(req):
            return
        engine.step()


def _drain(engine, limit=400):
    for _ in range(limit):
        if not engine.has_unfinished():
            return
        engine.step()


# each path: (name, needs prefix cache, fn(engine, prompt) ) -- fn leaves the engine idle
def _finish(e, p):
    e.add_request({"prompt_token_ids": p}, _params(), "r")
    _drain(e)


def _abort_waiting(e, p):
    e.add_request({"prompt_token_ids": p}, _params(), "r")
    e.abort("r")


def _abort_prefill(e, p):
    e.add_request({"prompt_token_ids": p}, _params(), "r")
    e.step()                                            # one chunk of a longer prompt
    e.abort("r")


def _abort_decode(e, p):
    e.add_request({"prompt_token_ids": p}, _params(max_tokens=20), "r")
    _run_until(e, "r", lambda r: len(r.output_ids) >= 3)
    e.abort("r")


def _stop_token(e, p):
    e.add_request({"prompt_token_ids": p}, _params(max_tokens=20), "r")
    _run_until(e, "r", lambda r: len(r.output_ids) >= 1)
    tok = e.requests["r"].output_ids[-1] if "r" in e.requests else None
    _drain(e)
    if tok is not None:   # a second request that stops on its own first token
        e.add_request({"prompt_token_ids": p}, _params(max_tokens=20, stop_token_ids=[tok]), "s")
        _drain(e)


def _preempt(e, p):
    e.add_request({"prompt_token_ids": p}, _params(max_tokens=8), "r")
    e.add_request({"prompt_token_ids": p[::-1]}, _params(max_tokens=8), "s")
    _run_until(e, "s", lambda r: r.num_computed > 0)
    if "s" in e.requests and e.requests["s"] in e.scheduler.running:
        e.scheduler.preempt(e.requests["s"])
    _drain(e)


def _prefix_hit_abort(e, p):
    e.add_request({"prompt_token_ids": p}, _params(max_tokens=2), "warm")
    _drain(e)
    e.add_request({"prompt_token_ids": p + [1, 2, 3]}, _params(max_tokens=20), "r")
    _run_until(e, "r", lambda r: len(r.output_ids) >= 2)
    e.abort("r")


def _prompt_logprobs(e, p):
    e.add_request({"prompt_token_ids": p}, _params(max_tokens=2, prompt_logprobs=1), "r")
    _drain(e)


PATHS = [
    ("finish at max_tokens", False, _finish),
    ("finish on a stop token", False, _stop_token),
    ("abort while waiting", False, _abort_waiting),
    ("abort during chunked prefill", False, _abort_prefill),
    ("abort during decode", False, _abort_decode),
    ("preempted, then finished", False, _preempt),
    ("prompt logprobs", False, _prompt_logprobs),
    ("prefix-cache hit, then abort", True, _prefix_hit_abort),
    ("prefix-cache hit, finished", True, lambda e, p: (_finish(e, p), _finish(e, p + [7]))),
]
