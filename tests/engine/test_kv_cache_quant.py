"""The quantised KV cache (`--kv-cache-dtype fp8_e4m3|int8`, `--kv-cache-layer-dtype`): DSA latent
rows and indexer keys stored as quantised rows with their scales inside. The bytes a cache
allocates are what memory planning counts; logits stay close to the float cache, never read
unwritten rows (NaN-poisoned); a prefix hit gives a cold run's tokens; a prefill/decode pair
joined by a real transfer equals one engine; bad specs are refused naming the layer."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ouro.config import EngineConfig, parse_layer_kv
from ouro.engine.llm_engine import LLMEngine
from ouro.engine.simple_runner import SimpleRunner
from ouro.layers.context import ModelCache, QuantisedRows
from ouro.models.loader import load_model
from ouro.models.presets import PRESETS
from ouro.models.resolve import resolve_model
from ouro.engine.options import check_engine_options


def _stored_bytes(cache):
    total = 0
    for store in (cache.latent, cache.index_keys, cache.index_gates, cache.index_pooled):
        total += sum(t.nbytes for t in (store if isinstance(store, list) else [store]))
    return total


@pytest.mark.parametrize("preset, kinds", [("tiny", {3: "fp8_e4m3"}), ("small", {3: "int8", 7: "fp8_e4m3"}),
                                           ("small", {7: "int8"}), ("small", {})])
def test_a_cache_allocates_what_planning_counts(preset, kinds):
    c = PRESETS[preset]
    cache = ModelCache(c, n_slots=1, n_pages=3, page_size=64, dtype=torch.bfloat16, kv_kinds=kinds)
    assert _stored_bytes(cache) == 3 * 64 * c.cache_bytes_per_token(torch.bfloat16, kinds)
    assert (c.cache_bytes_per_token(torch.bfloat16, kinds) < c.cache_bytes_per_token(torch.bfloat16)) == bool(kinds)
    for li, layer in enumerate(c.dsa_layers):
        assert isinstance(cache.latent_rows(li), QuantisedRows) == (layer in kinds)


@pytest.fixture(scope="module")
def tiny_py():
    return load_model(resolve_model("tiny-py"))


@pytest.mark.parametrize("kind", ["fp8_e4m3", "int8"])
def test_logits_stay_close_to_the_float_cache_and_never_read_unwritten_rows(tiny_py, kind):
    c = tiny_py.config
    prompt = [list(range(5, 105))]
    ref_runner = SimpleRunner(tiny_py, 1, 128, poison=True)
    runner = SimpleRunner(tiny_py, 1, 128, poison=True, kv_kinds={layer: kind for layer in c.dsa_layers})
    ref, out = ref_runner.step(prompt, logits="all"), runner.step(prompt, logits="all")
    err = ((out - ref).norm() / ref.norm()).item()
    assert 0 < err < 5e-3, err
    for _ in range(3):                                   # decode steps read the cached rows back
        nxt = [[int(ref[-1].argmax())]]
        ref, out = ref_runner.step(nxt), runner.step(nxt)
        assert torch.isfinite(out).all() and ((out - ref).norm() / ref.norm()).item() < 5e-3


def test_a_prefix_hit_equals_a_cold_run_under_fp8(tiny_py):
    cfg = EngineConfig(max_memory=64 << 20, page_size=16, dtype="float32", kv_cache_dtype="fp8_e4m3")
    prompt = list(range(7, 90))
    from ouro.engine.sampling import SamplingParams
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)

    def run(engine):
        rid = engine.add_request({"prompt_token_ids": prompt}, greedy)
        out = []
        while engine.has_unfinished():
            out += [o for o in engine.step() if o.request_id == rid]
        return out[-1]
    cold = run(LLMEngine(tiny_py, None, cfg, verbose=False))
    warm_engine = LLMEngine(tiny_py, None, dataclasses.replace(cfg, enable_prefix_caching=True), verbose=False)
    first, again = run(warm_engine), run(warm_engine)
    assert again.cached_tokens >= 64 and first.cached_tokens == 0          # the second one hit whole pages
    assert cold.token_ids == first.token_ids == again.token_ids
    # a hit restores the KDA state and prefills the rest as another chunk: float32 noise, no more
    # (a row re-quantised, or a stale scale, would move these by the int8/fp8 step, ~1e-2)
    assert max(abs(a - b) for a, b in zip(cold.logprobs, again.logprobs)) < 1e-4


def test_layer_specs_are_checked():
    assert parse_layer_kv("0-1:bf16,3:fp8_e4m3") == {0: "bf16", 1: "bf16", 3: "fp8_e4m3"}
    with pytest.raises(ValueError, match="LAYER"):
        parse_layer_kv("3:fp4")
    with pytest.raises(ValueError, match="LAYER"):
        EngineConfig(kv_cache_layer_dtype="x:int8")
    with pytest.raises(ValueError, match=r"layer\(s\) \[0\] that are not DSA"):
        EngineConfig(kv_cache_layer_dtype="0:int8").kv_kinds(PRESETS["tiny"])
    assert EngineConfig(kv_cache_dtype="int8", kv_cache_layer_dtype="3:bf16").kv_kinds(PRESETS["tiny"]) == {}
    assert EngineConfig(kv_cache_layer_dtype="7:int8").kv_kinds(PRESETS["small"]) == {7: "int8"}
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="does not combine with --compile"):
        check_engine_options(EngineConfig(kv_cache_dtype="fp8_e4m3", compile=True), PRESETS["tiny"])


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_a_prefill_decode_pair_with_fp8_rows_equals_one_engine(tmp_path, backend):
    """Quantised rows travel as they are stored (values and scales together) and land in the
    decode worker's own pages: its greedy tokens equal one engine's with the same cache."""
    from ouro.lab.reference.checkpoint import make_hf_checkpoint
    from tests.helpers.disagg_pair import KW, LENGTHS, full, pair, params, prompts, run_pair, single
    make_hf_checkpoint("tiny", tmp_path)
    kw = dict(KW, kv_cache_dtype="fp8_e4m3")
    want = single(tmp_path, False, kw)
    p, d = pair(tmp_path, backend, kw=kw)
    try:
        assert d.engine.runner.cache.latent.dtype == torch.uint8
        for i, ids in enumerate(prompts()):
            p.add(f"r{i}", ids, params(i, False), d.reserve(f"r{i}", ids, params(i, False)))
        assert run_pair(p, d) == want
        assert d.transfers == {"completed": len(LENGTHS), "failed": 0} and full(p.engine) and full(d.engine)
    finally:
        p.close()
        d.close()


def test_numerics_compares_kv_policies_and_finds_a_scale_left_behind():
    import os

    from ouro.lab.faults.patch import applied_in_process
    from ouro.lab.faults.scoring import localises
    from ouro.lab.faults import all_faults
    from ouro.lab.numerics.probe import probe_numerics
    clean = probe_numerics("tiny", "impl=ouro", "kv=fp8_e4m3", prompt_len=48)
    assert all(f.severity == "info" for f in clean), [f.summary for f in clean]
    fault = next(f for f in all_faults() if f.name == "kv_row_scale_not_rewritten")
    with applied_in_process(fault, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))):
        found = probe_numerics("tiny", "impl=ouro", "kv=fp8_e4m3", prompt_len=48)
    assert found[0].severity in ("warning", "error") and localises(found[0], fault.localised), found[0].summary


def test_plan_reports_each_kv_policy():
    from ouro.engine.plan_report import format_plan
    c = PRESETS["flash"]
    text = format_plan("flash", c, [131072, 1048576])
    for kind in ("fp8_e4m3", "int8"):
        per_token = c.cache_bytes_per_token(torch.bfloat16, dict.fromkeys(c.dsa_layers, kind))
        assert f"{kind:<9} {per_token:,} B per token" in text
    assert per_token < c.cache_bytes_per_token(torch.bfloat16)


def test_preemption_by_recompute_keeps_the_greedy_tokens_under_fp8(tiny_checkpoint):
    """A page budget too small for everyone forces preemption: the recomputed requests rewrite their
    quantised rows and still give the tokens of an engine with room for all."""
    import random

    from ouro.engine.sampling import SamplingParams
    model = load_model(tiny_checkpoint)
    c = model.config
    kinds = dict.fromkeys(c.dsa_layers, "fp8_e4m3")
    per_page = 16 * ModelCache.bytes_per_token(c, torch.float32, kinds)
    rng = random.Random(0)
    prompts = [[rng.randrange(5, c.vocab_size) for _ in range(n)] for n in (5, 40, 77, 120, 33, 61)]
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)

    def run(pages):   # 4 state slots (memory planning gives slots at most half the budget), then `pages` pages
        slots = 4 * ModelCache.bytes_per_slot(c)
        cfg = EngineConfig(page_size=16, max_num_seqs=4, max_num_batched_tokens=48, dtype="float32",
                           kv_cache_dtype="fp8_e4m3", max_memory=slots + max(slots, pages * per_page))
        engine = LLMEngine(model, None, cfg, verbose=False)
        ids = [engine.add_request({"prompt_token_ids": p}, params) for p in prompts]
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        return [done[i] for i in ids], engine.scheduler.num_preemptions
    tight, preemptions = run(20)
    roomy, none = run(200)
    assert preemptions > 0 and none == 0
    assert tight == roomy
