"""`ouro tune`: the config file it writes (read back by `LLM(config=)`, `ouro serve --config` and
`ouro bench offline --config`, flags over the file), the tie rule of its exactness check, its
search space, and a real search on `tiny-py` in worker processes: a candidate that changes greedy
outputs is never timed, an output-changing option outside the bits/byte budget is refused, every
candidate is journaled and a rerun resumes from the journal without running anything."""

from __future__ import annotations

import json
import time

import pytest

from ouro.config import EngineConfig, ModelConfig
from ouro.config.file import load_config_file, write_config_file
from ouro.models.resolve import resolve_model
from ouro.tune.report import format_journal
from ouro.tune.search import TIE, Tuner, Workload, greedy_agree, logprob_noise
from ouro.tune.space import BASELINE, Option, Space, apply, choice_of, lossy_fields, search_space


def test_config_file_round_trip_and_errors(tmp_path):
    p = tmp_path / "tuned.toml"
    fields = {"dtype": "float32", "quantization": "w8a8", "page_size": 16, "compile": True, "kv_cache_dtype": "int8"}
    write_config_file(p, fields, comment="a test", extra={"model": "tiny-py"})
    assert load_config_file(p) == fields
    listed = {**fields, "quantization_ignore": ("*.kv_b_proj", 'odd"name')}     # a TOML array back as a tuple
    write_config_file(p, listed)
    assert load_config_file(p) == listed
    (tmp_path / "bad.toml").write_text("[engine]\npage_sise = 16\n")
    with pytest.raises(ValueError, match="page_sise"):
        load_config_file(tmp_path / "bad.toml")
    (tmp_path / "worse.toml").write_text("[engine]\nquantization = 'int4'\n")
    with pytest.raises(ValueError, match="quantization must be"):
        load_config_file(tmp_path / "worse.toml")
    with pytest.raises(ValueError, match="does not exist"):
        load_config_file(tmp_path / "none.toml")
    # settings above the [engine] line, or under a misspelt table, are refused, not dropped
    (tmp_path / "flat.toml").write_text('quantization = "w8a8"\ncompile = true\n')
    with pytest.raises(ValueError, match=r"\['compile', 'quantization'\] outside the \[engine\]"):
        load_config_file(tmp_path / "flat.toml")
    (tmp_path / "typo.toml").write_text("[engnie]\ncompile = true\n")
    with pytest.raises(ValueError, match="engnie"):
        load_config_file(tmp_path / "typo.toml")
    # one pattern given as a string, not a list, was read letter by letter (and lm_head quantised)
    (tmp_path / "string.toml").write_text('[engine]\nquantization_ignore = "lm_head"\n')
    with pytest.raises(ValueError, match=r"quantization_ignore must be a list .*\['lm_head'\]"):
        load_config_file(tmp_path / "string.toml")
    with pytest.raises(ValueError, match="quantization_ignore must be a list"):
        EngineConfig(quantization="w8a8", quantization_ignore="lm_head")
    (tmp_path / "both.toml").write_text("[engine]\ncompile = true\n[tune]\nmodel = 'tiny'\n")
    assert load_config_file(tmp_path / "both.toml") == {"compile": True}


def test_llm_and_serve_read_the_file_and_flags_win(tmp_path):
    from ouro import LLM
    from ouro.cli import apply_config_file, build_parser
    p = tmp_path / "tuned.toml"
    write_config_file(p, {"page_size": 16, "quantization": "w8a8", "max_num_batched_tokens": 512,
                          "quantization_ignore": ("*.kv_b_proj",)})
    llm = LLM("tiny-py", max_memory=32 << 20, config=str(p), max_num_batched_tokens=256)
    cfg = llm.engine.config
    assert (cfg.page_size, cfg.quantization, cfg.max_num_batched_tokens) == (16, "w8a8", 256)
    assert llm.engine.quantized is not None                        # the file's quantisation was applied
    assert "lm_head" in llm.engine.quantized["quantized"] and "lm_head" not in llm.engine.quantized["kept"]
    argv = ["serve", "--config", str(p), "--page-size", "32"]
    args = build_parser(argv).parse_args(argv)
    args.argv = argv
    apply_config_file(args)
    assert (args.page_size, args.quantization, args.max_num_batched_tokens) == (32, "w8a8", 512)
    from ouro.config.engine import split_patterns
    assert split_patterns(args.quantization_ignore) == ("*.kv_b_proj",)       # the flag's comma-separated form


def test_tie_rule_of_the_exactness_check():
    ref = [{"tokens": [5, 6, 7], "top": [{"5": -0.1, "9": -3.0}, {"6": -0.5, "8": -0.5 - TIE / 2}, {"7": -0.2}]}]
    top = [{"5": -0.1}, {"6": -0.5}, {"7": -0.2}]
    assert greedy_agree(ref, [{"tokens": [5, 6, 7], "top": top}]) is None
    assert greedy_agree(ref, [{"tokens": [5, 8, 1], "top": top}]) is None          # a tie at position 1
    assert "position 0" in greedy_agree(ref, [{"tokens": [9, 6, 7], "top": top}])   # not a tie
    # a margin of 0.02 is no tie for runs that agree to float rounding, but is one for runs whose
    # logprobs of the same picks differ by 0.01 (a W8A8 rounding step)
    ref = [{"tokens": [5, 6], "top": [{"5": -0.1, "9": -3.0}, {"6": -0.50, "8": -0.52}]}]
    assert logprob_noise(ref, [{"tokens": [5, 8], "top": [{"5": -0.11}, {"8": -0.5}]}]) == pytest.approx(0.01)
    assert greedy_agree(ref, [{"tokens": [5, 8], "top": [{"5": -0.11}, {"8": -0.5}]}]) is None
    assert "position 1" in greedy_agree(ref, [{"tokens": [5, 8], "top": [{"5": -0.1}, {"8": -0.5}]}])
    # ... and runs that agree on every token but not on their logprobs do not compute the same model
    assert "differ by up to 0.200" in greedy_agree(ref, [{"tokens": [5, 6], "top": [{"5": -0.3}, {"6": -0.5}]}])


def test_search_space_and_choices():
    c = ModelConfig.from_hf(resolve_model("tiny-py"))
    space = search_space(c, 8, cores=1)
    names = [o.name for o in space.options]
    assert "parallelism" not in names and "parallelism" in space.left_out
    assert ("speculation" in names) == c.has_mtp
    q = next(o for o in space.options if o.name == "quantization")
    cfg = apply(dict(BASELINE), q, {"quantization": "w8a8"})
    assert choice_of(cfg, q) == "w8a8" and apply(cfg, q, {}) == BASELINE
    head = apply(cfg, q, dict(q.choices[-1][1]))
    assert "lm_head" not in head["quantization_ignore"] and "*.kv_b_proj" in head["quantization_ignore"]
    assert choice_of(json.loads(json.dumps(head)), q) == "w8a8 with the head"      # as a journal reads it back
    assert lossy_fields({**cfg, "page_size": 16}, space) == {"dtype": "float32", "quantization": "w8a8"}
    slow = search_space(c, 8, cores=1, gemm_rates={"bfloat16": 0.95, "float32": 156.5})   # AVX2 without bf16
    assert "dtype" not in [o.name for o in slow.options] and "0.95 GFLOP/s" in slow.left_out["dtype=bfloat16"]
    fast = search_space(c, 8, cores=1, gemm_rates={"bfloat16": 600.0, "float32": 150.0})
    assert next(o for o in fast.options if o.name == "dtype").choices[1] == ("bfloat16", {"dtype": "bfloat16"})
    budgets = next(o for o in search_space(c, 8, cores=1, input_len=128).options if o.name == "max_num_batched_tokens")
    assert budgets.choices[0] == ("2048", {}) and budgets.exact       # the default first; exact: tokens unchanged
    assert budgets.choices[-1] == ("136 (one prompt a step)", {"max_num_batched_tokens": 136})
    assert len(next(o for o in space.options if o.name == "max_num_batched_tokens").choices) == 3   # no prompt length
    two = search_space(ModelConfig.from_hf(resolve_model("tiny")), 8, cores=2)
    par = next(o for o in two.options if o.name == "parallelism")
    assert par.choices[1][1] == {"tensor_parallel_size": 2, "expert_parallel": False}


def test_a_ttft_objective_needs_the_serve_workload(tmp_path):
    d = resolve_model("tiny")
    with pytest.raises(ValueError, match="--workload serve"):
        Tuner(d, Workload(objective="ttft"), tmp_path / "a.jsonl", quality_dir=d, progress=False)
    with pytest.raises(ValueError, match="objective must be one of"):
        Tuner(d, Workload(kind="serve", objective="latency"), tmp_path / "b.jsonl", quality_dir=d, progress=False)


@pytest.mark.processes
@pytest.mark.slow       # 19 s: a whole offline search; the space, the exactness check's rule, the gap report by default
def test_a_search_checks_before_it_times_and_resumes_from_its_journal(tmp_path):
    d = resolve_model("tiny-py")
    journal = tmp_path / "j.jsonl"
    wl = Workload(num_prompts=4, input_len=24, output_len=6, concurrency=4, max_memory=32 << 20)

    def tuner():
        t = Tuner(d, wl, journal, budget=0.007, quality_dir=d, rounds=1, check_prompts=2, check_tokens=12,
                  quality_bytes=3000, progress=False, log=lambda s: None)
        # a planted fault: the small-chunk candidate's greedy tokens come back changed (as a
        # broken fast path would make them), and a budget no quantisation meets
        t.space = Space([Option("page_size", (("64", {}), ("16", {"page_size": 16})), exact=True),
                         Option("chunks", (("2048", {}), ("512", {"max_num_batched_tokens": 512})), exact=True),
                         Option("quantization", (("none", {}), ("w8a8", {"quantization": "w8a8"})), exact=False),
                         Option("pages", (("64", {}), ("32", {"page_size": 32})), exact=True)])
        real = t.greedy

        def greedy(w):
            if w.fields.get("page_size") == 32:      # a worker that dies mid-measurement
                w.proc.kill()
                w.proc.wait()
            out = real(w)
            if w.fields.get("max_num_batched_tokens") == 512:
                out[1]["tokens"] = [x + 1 for x in out[1]["tokens"]]
            return out
        t.greedy = greedy
        return t

    t = tuner()
    t.budget = -1.0                 # nothing output-changing passes
    best = t.search()
    t.close()
    entries = {e["option"]: e for e in t.journal.in_order("candidate")}
    assert entries["page_size"]["check"].startswith("greedy tokens agree") and "ab" in entries["page_size"]
    assert entries["chunks"]["why"].startswith("check failed: prompt 1 position 0") and "ab" not in entries["chunks"]
    q = entries["quantization"]
    assert q["why"].startswith("check failed: held-out bits/byte") and "ab" not in q
    assert 0 < abs(q["quality_cost"]) < 0.05 and q["bits_per_byte_fp32"] > 0
    assert entries["pages"]["why"].startswith("failed while measured: the worker exited"), entries["pages"]
    assert best in (BASELINE, {**BASELINE, "page_size": 16})
    lines = journal.read_text().splitlines()
    assert len([json.loads(x) for x in lines if json.loads(x)["phase"] == "candidate"]) == 4
    # a rerun reads every candidate back: nothing is measured again, the same winner comes out
    again = tuner()
    again.worker = lambda config: pytest.fail("a journaled candidate was run again")
    assert again.search() == best
    assert journal.read_text().splitlines() == lines
    EngineConfig(**best)


@pytest.mark.processes
@pytest.mark.slow       # 15 s: a real server per candidate
def test_the_serve_worker_answers_as_the_engine_worker(tmp_path):
    """--workload serve's candidate is a real `ouro serve --config` process: its greedy check over
    /v1/completions gives the engine-process worker's tokens and logprobs, a run under streaming
    load reports throughput, TTFT and the step between tokens, a combination the server refuses
    is a ValueError with the server's reason, and a journal of another workload is refused."""
    from ouro.tune.server_worker import ServerWorker
    from ouro.tune.worker import Worker
    d = resolve_model("tiny")
    wl = Workload(num_prompts=4, input_len=16, output_len=6, concurrency=2, max_memory=32 << 20, kind="serve")
    served = ServerWorker(d, dict(BASELINE), wl.__dict__)
    engine = Worker(d, dict(BASELINE), wl.__dict__)
    try:
        prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
        got = served.ask({"cmd": "greedy", "prompts": prompts, "max_tokens": 8})["outputs"]
        want = engine.ask({"cmd": "greedy", "prompts": prompts, "max_tokens": 8})["outputs"]
        run = served.ask({"cmd": "run"})
    finally:
        served.close()
        engine.close()
    assert [g["tokens"] for g in got] == [w["tokens"] for w in want] and len(got[1]["tokens"]) == 8
    assert logprob_noise(want, got) < 1e-4 and got[0]["top"][0].keys() == want[0]["top"][0].keys()
    assert run["output_tokens"] == 4 * 6 and run["seconds"] > 0 and 0 < run["ttft_s"] < 30 and 0 < run["decode_step_s"] < 5
    with pytest.raises(ValueError, match="MTP"):
        ServerWorker(d, {**BASELINE, "speculative_algorithm": "NEXTN"}, wl.__dict__)
    Tuner(d, wl, tmp_path / "j.jsonl", quality_dir=d, progress=False).close()
    with pytest.raises(ValueError, match="another workload"):
        Tuner(d, Workload(num_prompts=5, kind="serve"), tmp_path / "j.jsonl", quality_dir=d, progress=False)


@pytest.mark.processes
@pytest.mark.slow       # a whole search of real servers (the worker itself: the test above)
def test_the_serve_workload_times_real_servers_and_checks_through_http(tmp_path):
    """--workload serve: a search over real servers; a candidate the server refuses is journaled
    with the server's reason; the winner's gap report is journaled."""
    d = resolve_model("tiny")
    wl = Workload(num_prompts=4, input_len=16, output_len=6, concurrency=2, max_memory=32 << 20, kind="serve")
    t = Tuner(d, wl, tmp_path / "j.jsonl", quality_dir=d, rounds=1, check_prompts=2, check_tokens=8,
              progress=False, log=lambda s: None)
    t.space = Space([Option("page_size", (("64", {}), ("16", {"page_size": 16})), exact=True),
                     Option("speculation", (("off", {}), ("NEXTN", {"speculative_algorithm": "NEXTN"})), exact=True)])
    best = t.search()
    t.close()
    e = {x["option"]: x for x in t.journal.in_order("candidate")}
    ps = e["page_size"]
    assert ps["check"].startswith("greedy tokens agree"), ps
    for side in ("a", "b"):       # the clients' view: first tokens and the step between tokens
        assert 0 < ps["ab"]["ttft_s"][side] < 30 and 0 < ps["ab"]["decode_step_s"][side] < 5
    assert ps["ab"]["output_tok_s"]["a"] > 0
    sp = e["speculation"]
    assert sp["why"].startswith("refused: ouro serve exited") and "MTP" in sp["why"] and "ab" not in sp, sp
    assert best in (BASELINE, {**BASELINE, "page_size": 16})

    # the gap report: the engine's decode step part by part, each against its floor, journaled
    gap = t.gap(best)
    rows = {r["part"]: r for r in gap["rows"]}
    assert gap["batch"] == 2 and gap["floor_ms"] > 0 and gap["plain_step_ms"] > 0
    assert sum(r["ms"] for r in gap["rows"]) == pytest.approx(gap["hooked_step_ms"], rel=0.05)
    assert rows["routed experts"]["floor_ms"] > 0 and rows["KDA"]["ms"] > 0
    from ouro.measure.step_breakdown import format_breakdown
    assert "routed experts" in format_breakdown(gap) and t.journal.get("gap", best)["breakdown"] == gap

    # --objective ttft: the clients' median first-token times decide, not the workload's time
    wl = Workload(num_prompts=4, input_len=16, output_len=6, concurrency=2, max_memory=32 << 20, kind="serve",
                  objective="ttft")
    t = Tuner(d, wl, tmp_path / "ttft.jsonl", quality_dir=d, rounds=1, check_prompts=2, check_tokens=8,
              progress=False, log=lambda s: None)
    t.space = Space([Option("max_num_batched_tokens", (("2048", {}), ("18", {"max_num_batched_tokens": 18})),
                            exact=True)])
    t.search()
    t.close()
    ab = t.journal.in_order("candidate")[0]["ab"]
    assert ab["objective"] == "ttft" and ab["ratio"] == pytest.approx(ab["ttft_s"]["b"] / ab["ttft_s"]["a"])
    assert "TTFT ratio" in format_journal(t.journal.in_order("candidate"))



def test_the_gap_report_splits_an_engine_step_by_part():
    """The engine's decode step part by part (hooks), each part against its own floor."""
    from ouro.config import EngineConfig
    from ouro.engine.llm_engine import LLMEngine
    from ouro.engine.sampling import SamplingParams
    from ouro.measure.roofline import Roofline
    from ouro.measure.step_breakdown import ROWS, decode_breakdown, format_breakdown
    from ouro.models.loader import load_model
    d = resolve_model("tiny")
    eng = LLMEngine(load_model(d), None, EngineConfig(max_memory=32 << 20, page_size=16, max_num_seqs=3),
                    verbose=False)
    roof = Roofline(flops_per_s=1e10, bytes_per_s=1e10)
    b = decode_breakdown(eng, [[5, 6, 7] * 6, [8, 9] * 7, [4] * 11], 2, roof,
                         SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    rows = {r["part"]: r for r in b["rows"]}
    assert set(rows) == set(ROWS) and b["batch"] == 3 and not eng.has_unfinished()
    assert rows["routed experts"]["floor_ms"] > 0 and rows["KDA"]["ms"] > 0 and rows["KDA"]["floor_ms"] > 0
    assert b["floor_ms"] > 0 and b["plain_step_ms"] > 0 and "over target" in format_breakdown(b)


def test_the_prefill_breakdown_splits_an_engine_prefill_by_part():
    """`ouro bench prefill --breakdown`: the engine's prefill of new prompts, hooked runs
    interleaved with plain ones, each part against its floor, and nothing left in the engine."""
    from ouro.config import EngineConfig
    from ouro.engine.llm_engine import LLMEngine
    from ouro.engine.sampling import SamplingParams
    from ouro.measure.roofline import Roofline
    from ouro.measure.step_breakdown import ROWS, format_breakdown, prefill_breakdown
    from ouro.models.loader import load_model
    d = resolve_model("tiny")
    eng = LLMEngine(load_model(d), None, EngineConfig(max_memory=32 << 20, page_size=16, max_num_seqs=3,
                                                      max_num_batched_tokens=32), verbose=False)
    roof = Roofline(flops_per_s=1e10, bytes_per_s=1e10)
    sets = [[[s + 3 + i for i in range(20)], [s + 5 + i for i in range(20)]] for s in range(4)]
    b = prefill_breakdown(eng, sets, roof, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    rows = {r["part"]: r for r in b["rows"]}
    assert set(rows) == set(ROWS) and b["batch"] == 2 and b["tokens"] == 40 and not eng.has_unfinished()
    assert b["steps"] == 2          # 40 tokens at 32 a step
    # the floor is the two steps' floors: each reads the head's weight again (one step would read it once)
    from ouro.measure.step_breakdown import step_part_floors
    assert b["floor_steps"] == 2
    one_step = step_part_floors(eng.model, roof, [20, 20], [0, 0])
    assert rows["embedding + head"]["floor_ms"] > 1e3 * one_step["embedding + head"] * 1.5
    assert sum(r["floor_ms"] for r in b["rows"]) > 1e3 * sum(one_step.values())
    assert rows["routed experts"]["floor_ms"] > 0 and rows["KDA"]["ms"] > 0 and rows["KDA"]["floor_ms"] > 0
    assert sum(r["ms"] for r in b["rows"]) == pytest.approx(b["hooked_step_ms"], rel=1e-6)
    text = format_breakdown(b)
    assert text.startswith("prefill of 2 x 20 tokens (2 engine steps)") and "over target" in text


def test_the_breakdown_charges_the_engine_apart_from_the_models_glue(monkeypatch):
    """The engine's work outside the model's forward (here a scheduler slowed by 30 ms a step) is
    its own row, with no floor; the model's forward outside its timed modules (the streams' copy)
    is another, with the streams' bytes as its floor. One row held both."""
    from ouro.config import EngineConfig
    from ouro.engine.llm_engine import LLMEngine
    from ouro.engine.sampling import SamplingParams
    from ouro.measure.roofline import Roofline
    from ouro.measure.step_breakdown import ENGINE, GLUE, format_breakdown, prefill_breakdown
    from ouro.models.loader import load_model
    eng = LLMEngine(load_model(resolve_model("tiny")), None,
                    EngineConfig(max_memory=32 << 20, page_size=16, max_num_seqs=3, max_num_batched_tokens=32),
                    verbose=False)
    schedule = eng.scheduler.schedule

    def slow(*a, **k):
        time.sleep(0.03)
        return schedule(*a, **k)
    monkeypatch.setattr(eng.scheduler, "schedule", slow)
    sets = [[[s + 3 + i for i in range(20)], [s + 5 + i for i in range(20)]] for s in range(4)]
    b = prefill_breakdown(eng, sets, Roofline(flops_per_s=1e10, bytes_per_s=1e10),
                          SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    rows = {r["part"]: r for r in b["rows"]}
    assert b["steps"] == 2
    assert rows[ENGINE]["ms"] >= 2 * 30 and rows[ENGINE]["floor_ms"] == 0
    assert 0 < rows[GLUE]["ms"] < 30 and rows[GLUE]["floor_ms"] > 0
    assert "no floor (the engine's own work)" in format_breakdown(b)
