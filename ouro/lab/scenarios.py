"""Named measurements: each scenario runs a short, real workload and returns numbers (the
budgets' vocabulary) plus, where traced, the spans and heartbeat samples of the run.

offline   LLM-engine generate on a few requests, traced with the heartbeat on
decode    decode_step_ms, roofline_ms (step_cost + measured roofline), ops_per_decode_step
prefill   prefill_ms (model only), offline_prefill_ms (one request's prefill + first token)
serve     a real `ouro serve` on a free port with --trace: ttft_p50_ms, tpot_ms, and its trace
          (serve_scenarios.py; `serve_url`: the same against a server already running)
leaks     leaked_pages, leaked_slots after a run where some requests are aborted
pd        pd_overhead and friends: a prefill handing its state to a real decode worker (pd_scenario.py)
"""

from __future__ import annotations

import statistics
import time

from .serve_scenarios import (LOAD_SECONDS, SERVE_MAIN, free_port, serve, serve_url,  # noqa: F401 (re-exported)
                              stream_completions, wait_ready)
from .workload import MAX_TOKENS, PROMPT_LEN, prompts  # noqa: F401 (re-exported)
_engines: dict = {}


def _engine(model_dir: str, max_num_seqs: int = 8):
    """One engine per model per process (loading is most of a scenario's cost)."""
    key = (str(model_dir), max_num_seqs)
    if key not in _engines:
        from ..config import EngineConfig
        from ..engine.llm_engine import LLMEngine
        from ..models.loader import load_model
        from ..models.resolve import load_tokenizer
        model = load_model(model_dir)
        cfg = EngineConfig(max_num_seqs=max_num_seqs, max_memory=64 << 20, page_size=16, max_model_len=512)
        _engines[key] = LLMEngine(model, load_tokenizer(model_dir), cfg, verbose=False)
    return _engines[key]


def _drain(engine) -> None:
    while engine.has_unfinished():
        engine.step()


def offline(model_dir, requests: int = 4, max_tokens: int = MAX_TOKENS, heartbeat: bool = True) -> dict:
    """Traced generate of `requests` prompts; returns measurements and the trace (Chrome JSON doc)."""
    from ..engine.sampling import SamplingParams
    from ..measure import heartbeat as hb
    from ..measure import spans
    engine = _engine(model_dir)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request({"prompt_token_ids": prompts(1)[0]}, SamplingParams(temperature=0, max_tokens=2))
    _drain(engine)                                    # warm-up, untraced
    spans.clear(), hb.clear()
    spans.enable()
    if heartbeat:
        hb.start()
        time.sleep(0.05)                              # idle samples: the heartbeat's baseline
    try:
        t = time.perf_counter()
        with spans.span("pending", cat="pending"):
            for p in prompts(requests, seed=1):
                engine.add_request({"prompt_token_ids": p}, params)
            _drain(engine)
        seconds = time.perf_counter() - t
    finally:
        hb.stop()
        spans.disable()
    doc = {"traceEvents": spans.chrome_events(process_name="ouro offline")}
    return {"measurements": {"offline_s": seconds, "offline_tok_s": requests * max_tokens / seconds},
            "trace": doc}


def decode(model_dir, batch: int = 4, steps: int = 6) -> dict:
    from ..measure.roofline import Roofline
    from ..measure.step_cost import decode_cost
    from ..engine.sampling import SamplingParams
    engine = _engine(model_dir)
    for p in prompts(batch, seed=2):
        engine.add_request({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True))
    engine.step()                                      # the prefill (all prompts fit one step)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    ops = _count_ops(engine.step)
    _drain(engine)
    roof = Roofline.measure()
    cost = decode_cost(engine.model, PROMPT_LEN + steps, batch)
    return {"measurements": {"decode_step_ms": 1e3 * statistics.median(times),
                             "roofline_ms": 1e3 * roof.floor_s(cost.flops, cost.bytes),
                             "ops_per_decode_step": ops}}


def _count_ops(fn) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))
    with Count():
        fn()
    return Count.n


def prefill(model_dir, length: int = PROMPT_LEN, repeats: int = 3) -> dict:
    import torch
    from ..measure.roofline import median_time
    from ..engine.sampling import SamplingParams
    from ..engine.simple_runner import SimpleRunner
    engine = _engine(model_dir)
    ids = prompts(1, length, seed=3)[0]

    def model_only():
        SimpleRunner(engine.model, 1, length).step([ids])

    def through_engine():
        engine.add_request({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1))
        _drain(engine)
    out = {}
    with torch.inference_mode():
        for name, fn in (("prefill_ms", model_only), ("offline_prefill_ms", through_engine)):
            out[name] = 1e3 * median_time(fn, repeats)
    return {"measurements": out}


def leaks(model_dir) -> dict:
    """Pages and slots lost over every request path of the leaks probe (one definition of a leak)."""
    from .leaks.probe import check_paths
    results = check_paths(str(model_dir))
    return {"measurements": {f"leaked_{k}": sum(r["lost"].get(k, 0) for r in results) for k in ("pages", "slots")}}


from .pd_scenario import pd  # noqa: E402 (its own file)

SCENARIOS = {"offline": offline, "decode": decode, "prefill": prefill, "leaks": leaks, "serve": serve, "pd": pd}
# which scenario measures each name (a check may combine measurements of several scenarios)
MEASURES = {"offline_s": "offline", "offline_tok_s": "offline", "decode_step_ms": "decode", "roofline_ms": "decode",
            "ops_per_decode_step": "decode", "prefill_ms": "prefill", "offline_prefill_ms": "prefill",
            "leaked_pages": "leaks", "leaked_slots": "leaks", "ttft_p50_ms": "serve", "tpot_ms": "serve",
            **dict.fromkeys(("pd_prefill_ms", "pd_with_transfer_ms", "pd_no_overlap_ms", "pd_handoff_ms", "pd_overhead",
                             "pd_overhead_no_overlap", "pd_send_overlap", "pd_compute_cpu_overhead", "pd_wait_overhead"), "pd")}
