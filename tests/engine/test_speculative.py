"""MTP speculative decoding (`--speculative-algorithm NEXTN`) on the built-in `tiny-py`, whose
trained MTP layer drafts: greedy outputs equal those without speculation token for token (K = 1,
2, 3, batched, both KDA state modes, preemption, prefix hits, stops and max_tokens inside accepted
drafts); the KDA state a verification commits equals the per-step materialised one bit for bit,
and the non-speculative run's to float32 rounding (bit for bit under deterministic inference:
test_speculative_deterministic.py); the rejection sampler's output distribution is the target's."""

from __future__ import annotations

import pytest
import torch

from ouro.engine.llm import LLM
from ouro.engine.sampling import SamplingParams
from ouro.engine.speculative import accept
from ouro.engine.options import check_engine_options

from tests.helpers.speculative_steps import PROMPTS, _decoded, _state, _verify

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def tokens(llm, prompts=PROMPTS, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def plain():
    return LLM("tiny-py", max_memory=128 << 20, page_size=16)


@pytest.fixture(scope="module")
def reference(plain):
    return tokens(plain)


@pytest.mark.parametrize("k, state", [(1, "replay"), (2, "replay"), (3, "replay"), (3, "per_step")])
def test_greedy_outputs_equal_those_without_speculation(reference, k, state):
    llm = LLM("tiny-py", max_memory=128 << 20, page_size=16,
              speculative_config={"method": "nextn", "num_speculative_tokens": k, "kda_state": state})
    assert tokens(llm) == reference
    stats = llm.engine.stats()
    assert stats["spec_verify_steps"] > 0
    assert 1.0 < stats["spec_accept_length"] <= k + 1               # the trained MTP layer does get drafts accepted
    assert len(stats["spec_accept_rate_per_position"]) == k
    assert llm.engine.pages.num_free == llm.engine.pages.num_total    # every page back


def test_max_tokens_and_stops_inside_accepted_drafts(plain, reference):
    llm = LLM("tiny-py", max_memory=128 << 20, page_size=16, speculative_config={"num_speculative_tokens": 3})
    for n in (1, 2, 3, 5):
        short = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        assert tokens(llm, params=short) == [t[:n] for t in reference]
    stop = reference[0][6]                        # a token the first prompt reaches mid-run
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop_token_ids=[stop])
    assert tokens(llm, params=params) == tokens(plain, params=params)


def test_preemption_and_prefix_hits_keep_the_tokens(plain, reference):
    # 3 state slots and 22 pages of 16 (slots get at most half the budget) for 6 prompts of 54-162
    # tokens: requests are preempted and recomputed mid-speculation
    from ouro.config import ModelConfig
    from ouro.layers.context import ModelCache
    from ouro.models.resolve import resolve_model
    c = ModelConfig.from_hf(resolve_model("tiny-py")).with_mtp_layer()
    long = [p * 6 for p in PROMPTS]
    tight = LLM("tiny-py", max_memory=6 * ModelCache.bytes_per_slot(c), page_size=16, max_num_seqs=4,
                max_num_batched_tokens=32, speculative_config={"num_speculative_tokens": 2})
    expected = tokens(plain, long)
    assert tokens(tight, long) == expected
    assert tight.engine.stats()["preemptions"] > 0
    cached = LLM("tiny-py", max_memory=128 << 20, page_size=16, enable_prefix_caching=True,
                 speculative_config={"num_speculative_tokens": 2})
    assert tokens(cached, long) == expected
    assert tokens(cached, long) == expected             # the second pass hits the cached prompt pages
    assert cached.engine.stats()["prefix_cached_tokens_served"] > 0


def test_seeded_sampling_is_reproducible():
    llm = LLM("tiny-py", max_memory=128 << 20, page_size=16, speculative_config={"num_speculative_tokens": 2})
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=7)
    first = tokens(llm, params=params)
    assert tokens(llm, params=params) == first


# ---- the KDA state a verification commits ----


@pytest.mark.parametrize("m", [1, 2, 3])
def test_replay_commits_the_per_step_state_bit_for_bit(plain, m):
    prompt = plain.engine.tokenizer.encode(PROMPTS[2]).ids
    drafts = [30, 31, 32]
    cache, slot, rec, start, inputs = _verify(plain, prompt, drafts, "replay")
    before = _state(cache, slot)
    rec.commit(cache, slot, m)
    replayed = _state(cache, slot)
    cache.conv[:, slot], cache.recurrent[:, slot] = before            # the same start for the baseline
    cache2, _, rec2, _, _ = _verify(plain, prompt, drafts, "per_step")
    assert torch.equal(_state(cache2, slot)[1], before[1])            # verification left the state alone
    rec2.commit(cache2, slot, m)
    per_step = _state(cache2, slot)
    assert torch.equal(replayed[0], per_step[0]) and torch.equal(replayed[1], per_step[1])
    assert rec.nbytes() < rec2.nbytes()                              # replay keeps inputs, not states
    # the non-speculative run: the same m tokens as decode steps, one at a time
    decoded = _decoded(plain, cache2, slot, before, inputs[:m], start)
    # to float32 rounding, not bit for bit: the verification computes its inputs as one 4-row
    # block where decode runs single rows, and this BLAS rounds those apart (the deterministic
    # mode below removes that)
    assert (replayed[0] - decoded[0]).abs().max() < 1e-5
    assert (replayed[1] - decoded[1]).abs().max() < 1e-5
    # committing one position too far (or not rolling the window back) is visible
    cache2.conv[:, slot], cache2.recurrent[:, slot] = before
    rec.commit(cache2, slot, m + 1)
    assert not torch.equal(_state(cache2, slot)[1], replayed[1])
    assert not torch.equal(_state(cache2, slot)[0], replayed[0])


# ---- the rejection sampler ----

def _first_token_counts(p, q, rule, draws=20000, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p.shape[-1])
    for _ in range(draws):
        d = int(torch.multinomial(q[0], 1, generator=g))
        counts[rule([d], q, p, False, g)[0]] += 1
    return counts


def _chi_square(counts, probs):
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_rejection_sampling_gives_the_target_distribution():
    g = torch.Generator().manual_seed(1)
    V = 6
    p = torch.softmax(torch.randn(2, V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(1, V, generator=g) * 1.5, -1)
    # chi-square with V-1 = 5 degrees of freedom: P(X > 20.5) = 0.001
    assert _chi_square(_first_token_counts(p, q, accept), p[0]) < 20.5

    def always_accept(drafts, q, p, greedy, generator):          # a biased rule: the draft's distribution
        return list(drafts) + [int(torch.multinomial(p[len(drafts)], 1, generator=generator))]
    assert _chi_square(_first_token_counts(p, q, always_accept), p[0]) > 100


def test_greedy_acceptance_stops_at_the_first_mismatch():
    p = torch.eye(5)[[1, 2, 4, 0]]                 # the target's argmax at each position: 1, 2, 4, 0
    assert accept([1, 2, 3], None, p, True, None) == [1, 2, 4]
    assert accept([1, 2, 4], None, p, True, None) == [1, 2, 4, 0]
    assert accept([3], None, p, True, None) == [1]


def test_bad_speculative_options_are_refused(tmp_path):
    from ouro.lab.reference.checkpoint import make_hf_checkpoint
    from ouro.cli import build_parser
    from ouro.config import EngineConfig, speculative_args
    with pytest.raises(ValueError, match="speculative_algorithm must be NEXTN"):
        EngineConfig(speculative_algorithm="eagle")
    args = build_parser().parse_args(["serve", "--speculative-algorithm", "mtp", "--speculative-num-steps", "2",
                                      "--speculative-num-draft-tokens", "4"])
    with pytest.raises(ValueError, match="must be --speculative-num-steps \\+ 1"):
        speculative_args(args)
    make_hf_checkpoint("tiny", tmp_path)                       # no MTP layer
    with pytest.raises(ValueError, match="needs a checkpoint with an MTP layer"):
        LLM(str(tmp_path), max_memory=32 << 20, page_size=16, speculative_config={"method": "mtp"})
    with pytest.raises(ValueError, match="does not combine with context parallelism"):
        EngineConfig(speculative_algorithm="MTP", context_parallel_size=2)
        from ouro.config import ModelConfig
        from ouro.models.resolve import resolve_model
        check_engine_options(EngineConfig(speculative_algorithm="MTP", context_parallel_size=2),
                             ModelConfig.from_hf(resolve_model("tiny-py")))
    with pytest.raises(ValueError, match="unknown keys"):
        LLM("tiny-py", max_memory=32 << 20, page_size=16, speculative_config={"method": "mtp", "topk": 4})


def test_a_forced_prefix_is_drafted_and_emitted_exactly(plain):
    """Inside a forced prefix the drafts are the forced ids; the output is the forced prefix, then
    the model's own continuation, as without speculation (also when every step's last draft is
    made wrong on purpose, as the lab's spec=nextn:K does)."""
    llm = LLM("tiny-py", max_memory=128 << 20, page_size=16, speculative_config={"num_speculative_tokens": 3})
    forced = [40, 41, 42, 43, 44, 45, 46]
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, forced_prefix_ids=forced)
    want = tokens(plain, PROMPTS[:2], params)
    assert all(t[:7] == forced for t in want)
    assert tokens(llm, PROMPTS[:2], params) == want
    llm.engine.speculator.probe_reject_last = True
    assert tokens(llm, PROMPTS[:2], params) == want


def test_the_online_canary_takes_requests_off_speculation(reference):
    """A floor no request can reach (more tokens per verification than K + 1) and a ceiling every
    request passes both switch speculation off after the given tokens; outputs stay exact."""
    for key, value in (("canary_min_accept_length", 9.0), ("canary_max_accept_rate", 0.01)):
        llm = LLM("tiny-py", max_memory=128 << 20, page_size=16,
                  speculative_config={"num_speculative_tokens": 2, key: value, "canary_after": 6})
        assert tokens(llm) == reference
        stats = llm.engine.stats()
        assert stats["spec_canary_trips"] == len(PROMPTS)
        # off after the first verifications: far fewer than one per two output tokens
        assert stats["spec_verify_steps"] < len(PROMPTS) * 6
    quiet = LLM("tiny-py", max_memory=128 << 20, page_size=16, speculative_config={"num_speculative_tokens": 2})
    assert tokens(quiet) == reference and quiet.engine.stats()["spec_canary_trips"] == 0


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_a_prefill_decode_pair_speculates_and_keeps_the_tokens(backend):
    """Both workers speculate: the prefill worker sends the draft layer's rows of the prompt as one
    more layer, the decode worker drafts from them; greedy tokens equal one plain engine's."""
    import time

    from ouro.config import EngineConfig
    from ouro.disagg.decode_engine import DecodeEngine
    from ouro.disagg.prefill_engine import PrefillEngine
    from ouro.engine.llm_engine import LLMEngine
    from ouro.models.loader import load_model
    from ouro.models.resolve import resolve_model
    d = resolve_model("tiny-py")
    kw = dict(max_memory=64 << 20, page_size=16, dtype="float32", max_num_batched_tokens=64,
              speculative_algorithm="NEXTN", speculative_num_steps=2)
    prefill = PrefillEngine(LLMEngine(load_model(d), None, EngineConfig(**kw), verbose=False, model_dir=d))
    decode = DecodeEngine(LLMEngine(load_model(d), None, EngineConfig(**kw), verbose=False, model_dir=d), backend)
    plain = LLM("tiny-py", max_memory=64 << 20, page_size=16)
    tok = plain.engine.tokenizer
    prompts = [tok.encode(p * 3).ids for p in PROMPTS[:4]]             # 27-81 tokens: several chunks
    want = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    try:
        for i, ids in enumerate(prompts):
            room = decode.reserve(f"r{i}", ids, GREEDY)
            prefill.add(f"r{i}", ids, GREEDY, room)
        got, t = {}, time.monotonic()
        while (prefill.has_work() or decode.has_work()) and time.monotonic() - t < 120:
            prefill.step()
            for o in decode.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
            time.sleep(0.001)
        assert [got[f"r{i}"] for i in range(len(prompts))] == want
        stats = decode.engine.stats()
        assert stats["spec_verify_steps"] > 0 and stats["spec_accept_length"] > 1.3   # the sent rows draft well
        assert decode.transfers == {"completed": len(prompts), "failed": 0}
    finally:
        prefill.close()
        decode.close()


def test_n_samples_and_an_abort_mid_speculation(reference):
    """n > 1 fans out into requests that each speculate (seeded: reproducible); an abort between
    steps of a request carrying drafts returns its pages and leaves the others' tokens alone."""
    llm = LLM("tiny-py", max_memory=128 << 20, page_size=16, speculative_config={"num_speculative_tokens": 2})
    params = SamplingParams(n=3, max_tokens=12, temperature=0.9, seed=3, ignore_eos=True)
    first = [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS[:2], params)]
    assert [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS[:2], params)] == first
    assert all(len(set(map(tuple, outs))) > 1 for outs in first)       # the children differ
    eng = llm.engine
    ids = [eng.add_request(p, GREEDY) for p in PROMPTS[:3]]
    while not eng.requests[ids[1]].draft_ids:                         # until the victim carries drafts
        eng.step()
    assert eng.abort(ids[1])
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    assert set(done) == {ids[0], ids[2]} and [done[ids[0]], done[ids[2]]] == [reference[0], reference[2]]
    assert eng.pages.num_free == eng.pages.num_total and eng.slots.num_free == eng.slots.num_total


@pytest.mark.slow       # compiles tiny-py's decode step (aot_eager), ~30 s
def test_compiled_decode_steps_with_speculation(reference, monkeypatch):
    """--compile with speculation: draft-carrying rows run eagerly (K+1 tokens), steps of plain
    decode rows run the compiled graph, which also returns the hidden states drafting reads; the
    canary takes every request off speculation after 6 tokens, so the graph does run."""
    from ouro.engine import decode_graph
    monkeypatch.setattr(decode_graph, "BACKEND", "aot_eager")
    llm = LLM("tiny-py", max_memory=128 << 20, page_size=16, compile=True, max_num_seqs=8,
              speculative_config={"num_speculative_tokens": 2, "canary_min_accept_length": 9.0, "canary_after": 6})
    assert tokens(llm) == reference
    assert llm.engine.runner.graph.runs > 0 and llm.engine.stats()["spec_verify_steps"] > 0


def test_logprobs_and_stop_strings_under_speculation(plain):
    """Each emitted token's logprob comes from the verification row that chose it: the plain run's
    values to float32 rounding; a stop string met inside accepted drafts ends the text where the
    plain run ends it."""
    llm = LLM("tiny-py", max_memory=128 << 20, page_size=16, speculative_config={"num_speculative_tokens": 3})
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    for spec, ref in zip(llm.generate(PROMPTS[:3], params), plain.generate(PROMPTS[:3], params)):
        a, b = spec.outputs[0], ref.outputs[0]
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
        assert [[t for t, _ in row] for row in a.top_logprobs] == [[t for t, _ in row] for row in b.top_logprobs]
    text = plain.generate(PROMPTS[0], GREEDY)[0].outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
    want = plain.generate(PROMPTS[0], params)[0].outputs[0]
    got = llm.generate(PROMPTS[0], params)[0].outputs[0]
    assert got.text == want.text and got.finish_reason == want.finish_reason == "stop"

