"""Misuse and failure: bad options, prompts and params get a clear error and change nothing;
exceptions anywhere leave the engine usable and correct."""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from ouro import LLM, SamplingParams
from ouro.config import CheckpointError, EngineConfig
from ouro.engine.llm_engine import LLMEngine
from ouro.engine.memory import plan_memory
from ouro.models.loader import load_model
from ouro.models.presets import PRESETS, make_model
from tests.helpers.engine_drive import budget_for, drive

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tiny_checkpoint):
    return tiny_checkpoint


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(str(tiny_dir), max_memory=64 << 20, page_size=16)


def idle(engine):
    return (not engine.requests and not engine.has_unfinished() and engine.pages.num_free == engine.pages.num_total
            and engine.slots.num_free == engine.slots.num_total)


# ---- 2: a config without weights, a model that does not fit ----

def test_config_only_directory_is_refused_before_building(tmp_path):
    make_model("flash", tmp_path, progress=False)            # config + tokenizer, no weights
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_model(tmp_path)
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        LLM(str(tmp_path))


def test_flash_config_with_foreign_weights_fails_on_names_not_memory(tmp_path, tiny_dir):
    """313B parameters are never allocated: the check runs on a meta-device model."""
    make_model("flash", tmp_path, progress=False)
    (tmp_path / "model.safetensors").write_bytes((tiny_dir / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match="problems") as e:
        load_model(tmp_path)
    assert "and " in str(e.value) and str(e.value).count("\n") < 60   # long lists are cut


def test_model_larger_than_the_device_is_refused_with_figures(tiny_dir):
    need = sum(p.numel() * 4 for p in load_model(tiny_dir).state_dict().values())
    with pytest.raises(CheckpointError, match=f"{need:,} bytes.*{need - 1:,} bytes"):
        load_model(tiny_dir, available=need - 1)
    assert load_model(tiny_dir, available=need) is not None


@pytest.mark.processes
def test_generate_cli_on_config_only_directory(tmp_path):
    make_model("flash", tmp_path, progress=False)
    r = run_ouro("generate", str(tmp_path))
    assert r.returncode == 2 and "no *.safetensors" in r.stderr and "Traceback" not in r.stderr


# ---- 3: LLM.generate is exception-safe ----

def test_bad_prompt_mid_list_queues_nothing(llm):
    want = llm.generate(["Hello", "there"], GREEDY)
    with pytest.raises(ValueError, match="integers"):
        llm.generate(["Hello", {"prompt_token_ids": [1, "2"]}, "there"], GREEDY)
    assert idle(llm.engine)
    again = llm.generate(["Hello", "there"], GREEDY)
    assert [r.token_ids for r in again] == [r.token_ids for r in want]


def test_keyboard_interrupt_leaves_llm_usable(llm, monkeypatch):
    want = llm.generate(["Hello", "abc"], GREEDY)
    real, calls = llm.engine.step, []

    def interrupted():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real()
    monkeypatch.setattr(llm.engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["Hello", "abc"], GREEDY)
    monkeypatch.undo()
    assert idle(llm.engine)
    assert [r.token_ids for r in llm.generate(["Hello", "abc"], GREEDY)] == [r.token_ids for r in want]


@pytest.mark.parametrize("when", ["before", "after"])
def test_failed_forward_is_recomputed_not_resumed(tiny_dir, when):
    """A forward that raises after advancing KDA states (or before running): stepping on must
    give exactly the tokens of a run without the failure."""
    model = load_model(tiny_dir)
    cfg = EngineConfig(page_size=16, max_memory=budget_for(model.config, 40, 4), max_num_seqs=4,
                       max_num_batched_tokens=32)
    prompts = [list(range(5, 45)), list(range(100, 107)), list(range(200, 260))]
    params = [GREEDY, SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True), GREEDY]

    def run(fail_at):
        engine = LLMEngine(model, None, cfg, verbose=False)
        real, n = engine.runner.model, [0]

        def forward(ids, ctx):
            n[0] += 1
            if n[0] in fail_at and when == "before":
                raise RuntimeError("boom")
            out = real(ids, ctx)
            if n[0] in fail_at:
                raise RuntimeError("boom")
            return out
        engine.runner.model = forward
        rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        done, failures = {}, 0
        for _ in range(500):
            if not engine.has_unfinished():
                break
            try:
                done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
            except RuntimeError:
                failures += 1
        assert failures == len(fail_at) and idle(engine)
        return [done[r] for r in rids]
    assert run({2, 5}) == run(set())      # step 2: mid-prefill; step 5: mixed decode


# ---- 4: text held back for a possible stop string is not lost when EOS/stop token ends ----

def test_held_back_text_is_released_when_a_stop_token_ends(llm):
    base = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    tok = llm.engine.tokenizer
    ids = base.token_ids
    k = next(i for i in range(3, 12) if tok.decode(ids[:i]).strip() and ids.index(ids[i]) == i)
    text = tok.decode(ids[:k])
    # a stop string that starts with the text's last character, so it is held back before token k
    stop = text[-1] + "\u2603\u2603"
    res = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop],
                                                     stop_token_ids=[ids[k]]))[0]
    assert res.finish_reason == "stop" and res.token_ids == ids[:k + 1]
    # the held-back character is released; the stop token's own text is not part of the reply
    # (vLLM's rule, and the server's: `IncrementalDetokenizer.update`)
    assert res.text == text == tok.decode(res.token_ids[:-1])


# ---- 5: engine options ----

@pytest.mark.parametrize("option,value", [
    ("max_num_batched_tokens", 0), ("max_num_batched_tokens", -3), ("page_size", 0), ("max_num_seqs", 0),
    ("max_memory", 0), ("max_model_len", 0), ("kda_chunk_size", 0), ("torch_compile_max_bs", 0), ("memory_fraction", 0.0),
    ("memory_fraction", 1.5), ("dtype", "foo"), ("device", "tpu"), ("seed", "1"), ("page_size", 16.0),
    ("max_num_seqs", True)])
def test_engine_options_are_validated(option, value):
    with pytest.raises(ValueError, match=option):
        EngineConfig(**{option: value})


def test_option_conflicts_name_the_option(tiny_dir):
    model = load_model(tiny_dir)
    with pytest.raises(ValueError, match="index_kpool"):
        LLMEngine(model, None, EngineConfig(page_size=6, max_memory=1 << 24), verbose=False)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLMEngine(model, None, EngineConfig(page_size=64, max_num_batched_tokens=32, max_memory=1 << 24,
                                            enable_prefix_caching=True), verbose=False)
    with pytest.raises(ValueError, match="checkpoint_interval"):
        LLMEngine(model, None, EngineConfig(max_memory=1 << 24, enable_prefix_caching=True,
                                            prefix_checkpoint_interval=0), verbose=False)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA"):
            LLM(str(tiny_dir), device="cuda")


# ---- 6-9: params and prompts ----

def test_params_list_of_another_length_is_an_error(llm):
    with pytest.raises(ValueError, match="2 prompts but 3 SamplingParams"):
        llm.generate(["a", "b"], [GREEDY] * 3)
    with pytest.raises(ValueError, match="2 prompts but 1 SamplingParams"):
        llm.generate(["a", "b"], [GREEDY])
    assert idle(llm.engine)


def test_n_with_seed_gives_distinct_reproducible_samples(llm):
    p = SamplingParams(temperature=1.0, n=3, seed=11, max_tokens=8, ignore_eos=True)
    (res,) = llm.generate("abc", p)
    samples = [o.token_ids for o in res.outputs]
    assert len(set(map(tuple, samples))) == 3
    assert [o.token_ids for o in llm.generate("abc", p)[0].outputs] == samples
    for i in range(3):   # child i is the single request with seed + i
        alone = llm.generate("abc", dataclasses.replace(p, n=1, seed=11 + i))[0]
        assert alone.token_ids == samples[i]


@pytest.mark.parametrize("prompt", [{"prompt_token_ids": "567"}, {"prompt_token_ids": [5.0, 6]},
                                    {"prompt_token_ids": None}, {"prompt_token_ids": [True, 3]}, {"prompt_token_ids": [3, False]},
                                    None, 5, 3.5,
                                    {"prompt_token_ids": 7}, {"tokens": [1]}, [1, "2"]])
def test_prompt_token_ids_are_not_coerced(llm, prompt):
    with pytest.raises(ValueError, match="prompt"):
        llm.engine.add_request(prompt, GREEDY)
    assert idle(llm.engine)


def test_prompt_token_ids_accept_lists_of_ints(llm):
    import numpy as np
    a = llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY)[0].token_ids
    b = llm.generate({"prompt_token_ids": [np.int64(5), 6, 7]}, GREEDY)[0].token_ids
    assert a == b


@pytest.mark.parametrize("field,value", [("max_tokens", -1), ("temperature", -1.0), ("seed", "x"),
                                         ("top_p", 0.0), ("n", 0), ("stop_token_ids", 5), ("min_p", float("nan")),
                                         ("ignore_eos", "yes"), ("logprobs", 99)])
def test_params_changed_after_construction_are_rechecked(llm, field, value):
    p = SamplingParams(max_tokens=4)
    setattr(p, field, value)
    with pytest.raises(ValueError, match=field):
        llm.engine.add_request("hello", p)
    with pytest.raises(ValueError, match=field):
        llm.generate("hello", p)
    assert idle(llm.engine)


# ---- 10: the prefix-cache checkpoint pool is sized by use ----

def test_checkpoints_are_capped_by_the_pages():
    cfg = PRESETS["tiny"]
    plan = plan_memory(cfg, 12 << 30, 64, 64, checkpoint_fraction=0.1, max_model_len=4096)
    assert plan.n_pages == 64 * 4096 // 64 and plan.n_checkpoints == plan.n_pages
    plan2 = plan_memory(cfg, 12 << 30, 64, 64, checkpoint_fraction=0.1, max_model_len=4096, checkpoint_interval=4)
    assert plan2.n_checkpoints == plan2.n_pages // 4


def test_small_budget_still_caches_or_says_why(tiny_dir, caplog):
    model = load_model(tiny_dir)
    small = budget_for(model.config, 12, 2) + 2 * 9600
    e = LLMEngine(model, None, EngineConfig(page_size=16, max_memory=small, max_num_seqs=2,
                                            max_num_batched_tokens=64, enable_prefix_caching=True), verbose=False)
    assert e.plan.n_checkpoints >= 1 and e.prefix_cache is not None and e.stats()["prefix_caching"]
    prompt = list(range(10, 60))
    first = e.add_request(prompt, GREEDY)
    drive(e)
    second = e.add_request(prompt, GREEDY)
    out = drive(e)[second]
    assert out.cached_tokens == 48 and first != second
    # no room for a single checkpoint next to one page: caching is off, and the log says so
    tiny_budget = budget_for(model.config, 1, 1)
    with caplog.at_level("WARNING", logger="ouro.engine"):
        off = LLMEngine(model, None, EngineConfig(page_size=16, max_memory=tiny_budget, max_num_seqs=1,
                                                  max_num_batched_tokens=64, enable_prefix_caching=True),
                        verbose=False)
    assert off.prefix_cache is None and not off.stats()["prefix_caching"]
    assert "prefix caching is OFF" in caplog.text and off.prefix_caching_off_reason


# ---- 11: ids and the CLI ----

def test_automatic_ids_never_collide_with_user_ids(llm):
    e = llm.engine
    taken = [e.add_request([1, 2, 3], GREEDY, request_id=f"req-{i}") for i in range(40)]
    auto = e.add_request([1, 2, 3], GREEDY)
    assert auto not in taken
    with pytest.raises(ValueError, match="duplicate"):
        e.add_request([1, 2, 3], GREEDY, request_id="req-3")
    for r in taken + [auto]:
        e.abort(r)
    assert idle(e)


def run_ouro(*args):
    return subprocess.run([sys.executable, "-m", "ouro.cli", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})


@pytest.mark.processes
@pytest.mark.parametrize("args,message", [
    (["generate", "{tiny}", "--dtype", "foo"], "invalid choice"),
    (["generate", "{tiny}", "--max-memory", "0"], "max_memory"),
    (["generate", "{tiny}", "--prompt-token-ids", "1,x"], "comma-separated integers"),
    (["plan", "--model", "tiny", "--context", "-5"], "--context"),
    (["plan", "--model", "tiny", "--context", "abc"], "--context"),
    (["serve", "--model", "tiny", "--port", "99999"], "--port: must be an integer in 0..65535"),
    (["serve", "--model", "tiny", "--port", "-5"], "--port"),
    (["serve", "--model", "tiny", "--max-request-body-bytes", "-1"], "--max-request-body-bytes"),
    (["serve", "--model", "tiny", "--max-queued-requests", "-1"], "--max-queued-requests"),
    (["serve", "--model", "tiny", "--shutdown-timeout", "-5"], "--shutdown-timeout"),
    (["serve", "--model", "tiny", "--served-model-name", " "], "--served-model-name: must not be empty"),
    (["serve", "--model", "tiny", "--api-key", ""], "--api-key: must not be empty"),
    (["make-model", "tiny", "{file}/x"], "cannot create"),
    (["bench", "offline", "--model", "tiny", "--num-prompts", "0"], "--num-prompts: must be an integer >= 1"),
    (["bench", "prefill", "--model", "tiny", "--input-len", "0"], "--input-len"),
    (["bench", "serve", "--request-rate", "-1"], "--request-rate"),
    (["bench", "offline", "--model", "tiny", "--offline-page-size", "0"], "for `ouro bench serve` only"),
    (["bench", "prefill", "--model", "tiny", "--vocab-range", "0", "--seed", "3"], "--seed, --vocab-range"),
    (["bench", "offline", "--model", "tiny", "--config", "{dir}"], "cannot be read"),
    (["tune", "--model", "tiny", "--num-prompts", "-3"], "--num-prompts"),
    (["tune", "--model", "tiny", "--rounds", "0"], "--rounds"),
    (["tune", "--model", "tiny", "--quality-budget=-1%"], "--quality-budget"),
    (["tune", "--model", "tiny", "--output", "{file}/t.toml"], "does not exist"),
    (["probe", "leaks", "--model", "tiny", "--baseline", "{dir}/none.json"], "cannot read it"),
    (["generate", "{tiny}", "--prompt-token-ids="], "comma-separated integers"),
    (["make-model", "tiny", "{file}"], "not a directory"),
    (["make-model", "tiny", "{tiny}"], "--overwrite"),
] + ([] if torch.cuda.is_available() else [(["generate", "{tiny}", "--device", "cuda"], "no CUDA"),
                                            (["bench", "offline", "--model", "{tiny}", "--device", "cuda"], "no CUDA")]))
def test_cli_errors_are_one_line_not_tracebacks(tiny_dir, tmp_path, args, message):
    f = tmp_path / "a_file"
    f.write_text("x")
    r = run_ouro(*[a.format(tiny=tiny_dir, file=f, dir=tmp_path) for a in args])
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr
