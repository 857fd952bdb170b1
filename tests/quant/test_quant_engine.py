"""W8A8 through the engine: `LLM(..., quantization="w8a8")`, `ouro generate --quantization w8a8`,
greedy batch invariance (16 requests together give each one's tokens alone), and the options that
cannot combine refused before any weight is read."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from ouro import LLM, SamplingParams
from ouro.quant.w8a8 import W8A8Experts, W8A8Linear


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(str(checkpoint), max_memory=64 << 20, page_size=16, quantization="w8a8", max_num_seqs=16)


def test_the_engine_runs_the_quantised_modules(llm):
    mods = list(llm.engine.model.modules())
    assert any(isinstance(m, W8A8Linear) for m in mods) and any(isinstance(m, W8A8Experts) for m in mods)
    assert llm.engine.quantized["quantized"] and "lm_head" in llm.engine.quantized["kept"]


def test_greedy_outputs_are_batch_invariant(llm):
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + i, 17, 3 * i + 1, 40 + i] * (1 + i % 3)} for i in range(16)]
    together = [r.token_ids for r in llm.generate(prompts, greedy)]
    alone = [llm.generate(p, greedy)[0].token_ids for p in prompts]
    assert together == alone
    assert len({tuple(t) for t in together}) > 1          # not one degenerate answer for all


def test_quantised_logits_stay_close_to_float32(checkpoint, llm):
    from ouro.engine.simple_runner import SimpleRunner
    from ouro.models.loader import load_model
    prompt = [list(range(5, 37))]
    ref = SimpleRunner(load_model(checkpoint), 1, 64).step(prompt, logits="all")
    out = SimpleRunner(llm.engine.model, 1, 64).step(prompt, logits="all")
    err = ((out - ref).norm() / ref.norm()).item()
    assert 0 < err < 0.1, err      # random tiny weights (hidden 64); bits/byte on tiny-py is the quality measure


def test_an_unknown_quantization_is_refused(checkpoint):
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(str(checkpoint), max_memory=64 << 20, quantization="int3")


@pytest.mark.processes
def test_generate_cli_with_w8a8(checkpoint, llm):
    r = subprocess.run([sys.executable, "-m", "ouro.cli", "generate", str(checkpoint), "--quantization", "w8a8",
                        "--prompt-token-ids", "5,6,7", "--max-tokens", "6", "--ignore-eos", "--dtype", "float32"],
                       capture_output=True, text=True, timeout=300, env=os.environ.copy())
    assert r.returncode == 0, r.stderr
    want = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert r.stdout[:-1] == llm.engine.tokenizer.decode(want.token_ids)
    bad = subprocess.run([sys.executable, "-m", "ouro.cli", "generate", str(checkpoint), "--quantization", "w4"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


@pytest.mark.processes
def test_ignore_patterns_reach_the_engine(checkpoint):
    everything_kept = LLM(str(checkpoint), max_memory=64 << 20, page_size=16, quantization="w8a8",
                          quantization_ignore=("*",))
    assert not everything_kept.engine.quantized["quantized"]
    assert not any(isinstance(m, (W8A8Linear, W8A8Experts)) for m in everything_kept.engine.model.modules())
    r = subprocess.run([sys.executable, "-m", "ouro.cli", "generate", str(checkpoint), "--quantization", "w8a8",
                        "--quantization-ignore", "*", "--prompt-token-ids", "5,6,7", "--max-tokens", "6",
                        "--ignore-eos", "--dtype", "float32"], capture_output=True, text=True, timeout=300)
    plain = LLM(str(checkpoint), max_memory=64 << 20, page_size=16)
    want = plain.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert r.returncode == 0, r.stderr
    assert r.stdout[:-1] == plain.engine.tokenizer.decode(want.token_ids)


@pytest.mark.slow
def test_the_compiled_decode_graph_runs_the_quantised_model(checkpoint, llm):
    """--compile with W8A8: the int8 products run as opaque ops inside the graph (minutes to compile)."""
    compiled = LLM(str(checkpoint), max_memory=64 << 20, page_size=16, quantization="w8a8", compile=True,
                   torch_compile_max_bs=4, max_num_seqs=4)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9, 10, 11, 12]}]
    assert [r.token_ids for r in compiled.generate(prompts, greedy)] == [r.token_ids for r in llm.generate(prompts, greedy)]


def test_disaggregated_workers_get_the_same_quantisation():
    """`ouro serve --disagg XPYD --quantization w8a8`: both roles run the same products."""
    from ouro.cli import build_parser
    from ouro.disagg.command import worker_argv
    args = build_parser().parse_args(["serve", "--model", "tiny", "--disagg", "1P1D", "--quantization", "w8a8"])
    for role in ("prefill", "decode"):
        argv = worker_argv(args, role, 30000)
        assert argv[argv.index("--quantization") + 1] == "w8a8"
    plain = build_parser().parse_args(["serve", "--model", "tiny", "--disagg", "1P1D"])
    assert "--quantization" not in worker_argv(plain, "prefill", 30000)


@pytest.mark.parametrize("method", ["w8a8", "fp8"])
def test_kv_b_proj_stays_in_the_engine_dtype_whatever_the_ignore_list_says(checkpoint, method):
    """MLA absorbs kv_b_proj into the attention (its matrix is read, never run as a product): an
    ignore list without it still keeps it, so every other projection, the head included, is
    quantised and the engine runs."""
    if method == "fp8" and not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no float8 in this torch")
    llm = LLM(str(checkpoint), max_memory=64 << 20, page_size=16, quantization=method,
              quantization_ignore=("*.indexer.weights_proj",))
    model = llm.engine.model
    kv_b = [m for n, m in model.named_modules() if n.endswith("kv_b_proj")]
    assert kv_b and all(not isinstance(m, W8A8Linear) and m.weight.dtype == torch.float32 for m in kv_b)
    assert isinstance(model.lm_head, W8A8Linear)
    out = llm.generate([[1, 2, 3, 4, 5, 6]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 4


def test_bench_offline_passes_quantization_ignore_on(tmp_path):
    """`ouro bench offline --quantization-ignore` reaches the engine: what it kept is what was asked
    (with kv_b_proj, which is always kept)."""
    import json

    from ouro.cli import main
    out = tmp_path / "r.json"
    code = main(["bench", "offline", "--model", "tiny", "--num-prompts", "2", "--input-len", "12", "--output-len", "2",
                 "--max-concurrency", "2", "--quantization", "w8a8", "--quantization-ignore", "lm_head",
                 "--output-json", str(out)])
    r = json.loads(out.read_text())
    assert code == 0 and r["engine_fields"]["quantization_ignore"] == ["lm_head"]
    assert "lm_head" in r["kept_unquantised"]
    assert not any("indexer.weights_proj" in n for n in r["kept_unquantised"])
    assert r["kept_unquantised"] and all(n == "lm_head" or n.endswith("kv_b_proj") for n in r["kept_unquantised"])
