"""`--tp 2` in the engine and the server: rank 0 schedules, a follower process runs every forward
and KDA checkpoint operation alike; greedy outputs equal one rank's token for token (prefix hits,
preemption, expert parallelism); a follower that dies stops the engine with an error naming it
(no hang), and a server whose follower died fails the request in flight and reports itself
unhealthy."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from ouro.config import ModelConfig
from ouro.engine.llm import LLM
from ouro.engine.sampling import SamplingParams
from ouro.engine.tp_workers import TPBroken
from ouro.layers.context import ModelCache
from ouro.models.resolve import resolve_model

from tests.helpers.serve_helpers import Server, idle, pids_running, post
from tests.helpers.speculative_steps import PROMPTS

pytestmark = pytest.mark.processes

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
LONG = [p * 6 for p in PROMPTS]


def tokens_of(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def tokens(llm, prompts):
    return tokens_of(llm.generate(prompts, GREEDY))


@pytest.fixture(scope="module")
def reference():
    return tokens(LLM("tiny-py", max_memory=128 << 20, page_size=16), LONG)


def test_tp2_engine_equals_one_rank_through_preemption(reference):
    # 3 state slots per rank, and few pages, for six prompts of 54-162 tokens: preemption and recompute
    # (the budget is both ranks': each plans its cache from half of it)
    c = ModelConfig.from_hf(resolve_model("tiny-py"))
    tight = LLM("tiny-py", max_memory=6 * ModelCache.bytes_per_slot(c), page_size=16, max_num_seqs=4,
                max_num_batched_tokens=64, tensor_parallel_size=2)
    try:
        assert tight.engine.plan.n_slots == 3
        assert tight.engine.model.config.linear_num_heads * 2 == c.linear_num_heads     # rank 0 holds half the heads
        assert tokens(tight, LONG) == reference
        assert tight.engine.stats()["preemptions"] > 0
        assert tight.engine.pages.num_free == tight.engine.pages.num_total
    finally:
        tight.engine.close()


def test_tp2_engine_equals_one_rank_through_prefix_hits(reference):
    from ouro.measure import spans
    cached = LLM("tiny-py", max_memory=128 << 20, page_size=16, enable_prefix_caching=True, tensor_parallel_size=2)
    try:
        spans.clear()
        spans.enable()
        try:
            assert tokens(cached, LONG) == reference
        finally:
            spans.disable()
        cats = {e["cat"] for e in spans.events()}
        assert {"collective", "compute"} <= cats                  # the trace shows rank 0's collectives
        assert tokens(cached, LONG) == reference         # the second pass restores KDA checkpoints on both ranks
        assert cached.engine.stats()["prefix_cached_tokens_served"] > 0
    finally:
        cached.engine.close()


def test_ep2_engine_equals_one_rank_and_samples_from_the_best_candidates(reference):
    llm = LLM("tiny-py", max_memory=128 << 20, page_size=16, tensor_parallel_size=2, enable_expert_parallel=True)
    try:
        head = llm.engine.model.lm_head
        plain = LLM("tiny-py", max_memory=64 << 20, page_size=16)
        got = llm.generate(LONG, GREEDY)
        assert [o.outputs[0].token_ids for o in got] == reference
        picks = head.candidate_forwards
        assert picks > 0                    # plain greedy rows: only each rank's best token crossed
        want = plain.generate(LONG, GREEDY)  # ... and each token's reported logprob is still the true one
        assert max(abs(x - y) for a, b in zip(want, got) for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs)) < 1e-4
        topk = SamplingParams(max_tokens=6, temperature=0.7, top_k=5, top_p=0.9, seed=3, ignore_eos=True)
        assert tokens_of(llm.generate(PROMPTS[:3], topk)) == tokens_of(plain.generate(PROMPTS[:3], topk))
        assert head.candidate_forwards > picks
        with_lp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
        one = plain.generate(PROMPTS[:2], with_lp)
        picks = head.candidate_forwards
        two = llm.generate(PROMPTS[:2], with_lp)
        assert head.candidate_forwards == picks   # top logprobs read the logits: gathered
        for a, b in zip(one, two):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert max(abs(x - y) for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs)) < 1e-4
    finally:
        llm.engine.close()


@pytest.mark.slow         # each rank compiles the step: ~45 s on 2 cores
def test_tp2_ep2_compiled_decode_equals_one_rank(reference, monkeypatch):
    # --compile with --tp: every rank compiles the decode step; the collectives and the local
    # experts are opaque ops inside the graph, run in step on both ranks
    from ouro.engine import decode_graph
    monkeypatch.setattr(decode_graph, "BACKEND", "aot_eager")      # the followers are told the backend too
    llm = LLM("tiny-py", max_memory=128 << 20, page_size=16, tensor_parallel_size=2, enable_expert_parallel=True,
              compile=True, max_num_seqs=2)
    try:
        assert tokens(llm, LONG) == reference
        assert llm.engine.runner.graph.runs > 0
        assert llm.engine.pages.num_free == llm.engine.pages.num_total
    finally:
        llm.engine.close()


def test_a_lost_rank_stops_the_engine_with_an_error_naming_it():
    llm = LLM("tiny-py", max_memory=64 << 20, page_size=16, tensor_parallel_size=2)
    try:
        follower = llm.engine.tp.procs[0]
        follower.kill()
        follower.wait()
        start = time.monotonic()
        with pytest.raises(TPBroken, match="TP rank 1 of 2"):
            tokens(llm, PROMPTS[:2])
        assert time.monotonic() - start < 30                     # no wait on a collective
        with pytest.raises(TPBroken):                             # and it stays stopped
            tokens(llm, PROMPTS[:1])
    finally:
        llm.engine.close()


def _follower_pids():
    return pids_running(b"ouro.engine.tp_workers")


def test_serve_tp2_answers_as_one_rank_and_reports_a_lost_rank(tmp_path):
    expected = LLM("tiny-py", max_memory=64 << 20, page_size=16).generate(PROMPTS[:2], GREEDY)
    before = set(_follower_pids())
    server = Server(resolve_model("tiny-py"), "--tp", "2", tmp_path=tmp_path)
    try:
        followers = [p for p in _follower_pids() if p not in before]
        assert len(followers) == 1, followers
        for prompt, want in zip(PROMPTS[:2], expected):
            r = post(server, "/v1/completions", {"model": "tiny-py", "prompt": prompt, "max_tokens": 12,
                                                 "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want.outputs[0].text
        assert idle(server)
        os.kill(followers[0], signal.SIGKILL)
        r = post(server, "/v1/completions", {"model": "tiny-py", "prompt": PROMPTS[0], "max_tokens": 12})
        assert r.status_code >= 500 and "TP rank 1 of 2" in r.json()["message"], r.text
        deadline = time.monotonic() + 30
        while httpx.get(server.base + "/health", timeout=5).status_code == 200:
            assert time.monotonic() < deadline, "the server still says it is healthy"
            time.sleep(0.3)
        assert httpx.get(server.base + "/health", timeout=5).status_code == 503
    finally:
        server.stop()
