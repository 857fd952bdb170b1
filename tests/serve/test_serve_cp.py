"""`ouro serve --cp 2`: long prompts are prefilled across the engine and a helper rank and decode
on the engine, token for token as one rank; a helper killed mid-prefill fails that request with a
clear error (no hang), and the server serves on (CP off, pools back to full)."""

import os
import threading
import time

import pytest
import torch

from ouro.engine.llm_engine import LLMEngine
from ouro.config import EngineConfig
from ouro.engine.sampling import SamplingParams
from ouro.models.loader import load_model

from tests.helpers.serve_helpers import Server, idle, pids_running, post

pytestmark = pytest.mark.processes

THRESHOLD = 64


def greedy_ids(engine, prompts, n=8):
    ids = [engine.add_request({"prompt_token_ids": p}, SamplingParams(max_tokens=n, temperature=0.0)) for p in prompts]
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [out[i] for i in ids]


def test_cp_engine_decodes_as_one_rank(tiny_checkpoint):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 500, (n,), generator=g).tolist() for n in (150, 90, 20)]   # the last: below threshold
    model = load_model(tiny_checkpoint)
    kw = dict(max_memory=32 << 20, page_size=16, dtype="float32")
    one = greedy_ids(LLMEngine(model, None, EngineConfig(**kw), verbose=False), prompts)
    cp_engine = LLMEngine(load_model(tiny_checkpoint), None,
                          EngineConfig(context_parallel_size=2, cp_threshold=THRESHOLD, **kw), verbose=False,
                          model_dir=str(tiny_checkpoint))
    try:
        got = greedy_ids(cp_engine, prompts)
        assert got == one
        assert cp_engine.cp.broken is None and cp_engine.cp.num_prefills == 2   # the two long prompts
        assert cp_engine.scheduler.slots.num_free == cp_engine.scheduler.slots.num_total
    finally:
        cp_engine.cp.close()


@pytest.mark.slow       # a combination: CP=2 and TP=2 each run by default
def test_cp2_with_tp2_decodes_as_one_rank(tiny_checkpoint):
    # a TP x CP grid of four ranks: each CP index is a TP group with its shards; the long prompts'
    # KDA state (of each rank's heads) ends on the engine's TP group, which then decodes
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 500, (n,), generator=g).tolist() for n in (150, 90, 20)]
    kw = dict(max_memory=32 << 20, page_size=16, dtype="float32")
    one = greedy_ids(LLMEngine(load_model(tiny_checkpoint), None, EngineConfig(**kw), verbose=False), prompts)
    grid = LLMEngine(load_model(tiny_checkpoint), None,
                     EngineConfig(context_parallel_size=2, cp_threshold=THRESHOLD, tensor_parallel_size=2, **kw),
                     verbose=False, model_dir=str(tiny_checkpoint))
    try:
        assert len(grid.cp.pids) == 2 and len(grid.tp.pids) == 1      # CP index 0's two ranks; rank 0's follower
        assert greedy_ids(grid, prompts) == one
        assert grid.cp.broken is None and grid.cp.num_prefills == 2
        assert grid.scheduler.slots.num_free == grid.scheduler.slots.num_total
    finally:
        grid.close()


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def helper_pids():
    return pids_running(b"ouro.parallel.cp_prefill")


@pytest.mark.slow
def test_killing_a_rank_mid_prefill_fails_that_request_and_the_server_serves_on(tiny_checkpoint, tmp_path):
    before = set(helper_pids())
    server = Server(tiny_checkpoint, "--served-model-name", "tiny", "--cp", "2", "--cp-threshold", str(THRESHOLD), "--dtype", "float32",
                    tmp_path=tmp_path)
    try:
        helpers = [p for p in helper_pids() if p not in before]
        assert len(helpers) == 1, helpers
        g = torch.Generator().manual_seed(5)
        long_prompt = torch.randint(1, 500, (4000,), generator=g).tolist()
        result = {}

        def send():
            result["r"] = post(server, "/v1/completions", {"model": "tiny", "prompt": long_prompt, "max_tokens": 4})
        idle_cpu = cpu_seconds(helpers[0])
        t = threading.Thread(target=send)
        t.start()
        deadline = time.monotonic() + 60
        while cpu_seconds(helpers[0]) < idle_cpu + 0.05:      # the helper is computing its slice
            assert time.monotonic() < deadline, "the helper never started the prefill"
            time.sleep(0.02)
        os.kill(helpers[0], 9)
        t.join(timeout=120)
        assert not t.is_alive(), "the request hung on a collective"
        r = result["r"]
        assert r.status_code == 500, r.text
        assert "context-parallel prefill failed" in r.json()["message"], r.text
        # the server serves on: a long prompt now prefills on the engine alone, a short one as always
        for n in (200, 10):
            r = post(server, "/v1/completions", {"model": "tiny", "prompt": long_prompt[:n], "max_tokens": 3})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
        assert idle(server)
    finally:
        server.stop()


def test_timeline_shows_every_ranks_compute_and_exchange(tiny_checkpoint):
    """With tracing on, a CP prefill leaves the helper's spans on a lane of its own beside the
    engine's: both ranks compute at the same time and both take part in the exchange."""
    from ouro.measure import spans
    engine = LLMEngine(load_model(tiny_checkpoint), None,
                       EngineConfig(context_parallel_size=2, cp_threshold=THRESHOLD, max_memory=32 << 20,
                                    page_size=16, dtype="float32"), verbose=False, model_dir=str(tiny_checkpoint))
    spans.clear()
    spans.enable()
    try:
        greedy_ids(engine, [list(range(1, 130))], n=2)
    finally:
        spans.disable()
        engine.cp.close()
    ev = spans.events()
    lanes = {}
    for e in ev:
        lanes.setdefault(e["thread"], []).append(e)
    helper = lanes.get("cp rank 0", [])
    mine = [e for e in ev if e["thread"] != "cp rank 0"]
    for side in (helper, mine):
        assert any(e["name"] == "cp prefill" and e["cat"] == "compute" for e in side), side
        assert sum(e["name"] == "cp exchange" and e["cat"] == "transfer" for e in side) >= 2, side
    h = next(e for e in helper if e["name"] == "cp prefill")
    m = next(e for e in mine if e["name"] == "cp prefill")
    overlap = min(h["start_ms"] + h["dur_ms"], m["start_ms"] + m["dur_ms"]) - max(h["start_ms"], m["start_ms"])
    assert overlap > 0.5 * min(h["dur_ms"], m["dur_ms"]), (h, m)      # one clock, running side by side
    spans.clear()


@pytest.mark.slow       # a combination: CP=2, W8A8 and the FP8 cache each run by default
def test_cp_with_w8a8_and_an_fp8_cache_decodes_as_one_rank(tiny_checkpoint):
    """The helper ranks build the engine's model and cache: W8A8 products and fp8 cache rows on every
    rank, the same tokens as one rank running the same."""
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 500, (n,), generator=g).tolist() for n in (150, 20)]
    kw = dict(max_memory=32 << 20, page_size=16, dtype="float32", quantization="w8a8", kv_cache_dtype="fp8_e4m3")
    one = greedy_ids(LLMEngine(load_model(tiny_checkpoint), None, EngineConfig(**kw), verbose=False), prompts)
    cp_engine = LLMEngine(load_model(tiny_checkpoint), None,
                          EngineConfig(context_parallel_size=2, cp_threshold=THRESHOLD, **kw), verbose=False,
                          model_dir=str(tiny_checkpoint))
    try:
        assert greedy_ids(cp_engine, prompts) == one
        assert cp_engine.cp.broken is None and cp_engine.cp.num_prefills == 1
    finally:
        cp_engine.cp.close()
