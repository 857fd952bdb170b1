"""`ouro make-model` presets: sizes, determinism, transformers round trip; `ouro generate`."""

import hashlib
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.numerics import rel_rms
from ouro.engine.simple_runner import SimpleRunner
from ouro.models.loader import load_model
from ouro.models.presets import PRESETS, make_model, parameter_count


def run_ouro(*args, env=None, **kw):
    return subprocess.run([sys.executable, "-m", "ouro.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300, **kw)


def test_parameter_counts():
    assert parameter_count(PRESETS["tiny"]) < 1_000_000
    assert 125e6 <= parameter_count(PRESETS["small"]) <= 145e6
    assert 300e9 <= parameter_count(PRESETS["flash"]) <= 330e9


def test_tiny_layout():
    c = PRESETS["tiny"]
    assert c.layer_types.count("linear_attention") == 3 and c.layer_types.count("indexed_attention") == 1
    assert c.index_topk < 100  # ~100-token sequences exercise sparsity


@pytest.fixture(scope="module")
def cli_checkpoint(tmp_path_factory):
    """`ouro make-model tiny` run as a command (the session's `tiny_checkpoint` is made in process)."""
    d = tmp_path_factory.mktemp("tiny")
    r = run_ouro("make-model", "tiny", str(d))
    assert r.returncode == 0, r.stderr
    return d


@pytest.mark.processes
def test_make_model_is_deterministic(cli_checkpoint, tmp_path):
    make_model("tiny", tmp_path, progress=False)
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()
    for name in ("model.safetensors", "config.json", "tokenizer.json", "generation_config.json"):
        assert digest(cli_checkpoint / name) == digest(tmp_path / name), name


def test_transformers_loads_make_model_output(tiny_checkpoint):
    from transformers import AutoTokenizer, Glm5NextForConditionalGeneration
    hf = Glm5NextForConditionalGeneration.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    model = load_model(tiny_checkpoint)
    ids = torch.randint(0, 512, (150,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids.view(1, -1)).logits[0]
    out = SimpleRunner(model, 1, 256, poison=True).step([ids.tolist()], logits="all")
    assert rel_rms(out, ref) <= 1e-4
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.startswith("[gMASK]<sop>") and text.endswith("<|assistant|>\n<think>")


@pytest.mark.processes
def test_generate_streams_greedy_tokens(tiny_checkpoint):
    r = run_ouro("generate", str(tiny_checkpoint), "--prompt-token-ids", "5,6,7", "--max-tokens", "6",
                 "--ignore-eos")
    assert r.returncode == 0, r.stderr
    # the same greedy continuation computed here through the model directly
    model = load_model(tiny_checkpoint)
    runner = SimpleRunner(model, 1, 16)
    logits, want = runner.step([[5, 6, 7]]), []
    for _ in range(6):
        want.append(int(logits[0].argmax()))
        logits = runner.step([[want[-1]]])
    from ouro.models.resolve import load_tokenizer
    assert r.stdout[:-1] == load_tokenizer(tiny_checkpoint).decode(want)


@pytest.mark.processes
def test_generate_text_prompt_and_preset_cache(tmp_path):
    # a fresh preset cache; the machine's measurements and built kernels are linked in (building
    # every native family again took a minute of this test)
    from ouro.machine_cache import cache_root
    for entry in cache_root().iterdir() if cache_root().is_dir() else ():
        if entry.name != "presets":
            (tmp_path / entry.name).symlink_to(entry)
    r = run_ouro("generate", "tiny", "--prompt", "hello", "--max-tokens", "4", "--ignore-eos",
                 env={"OURO_CACHE": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "presets" / "tiny" / "model.safetensors").is_file()


@pytest.mark.processes
def test_generate_errors_are_clear(tmp_path, tiny_checkpoint):
    r = run_ouro("generate", str(tmp_path / "nope"))
    assert r.returncode == 2 and "neither a checkpoint directory nor a preset" in r.stderr
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((tiny_checkpoint / name).read_bytes())
    r = run_ouro("generate", str(bare), "--prompt", "hi")
    assert r.returncode == 2 and "no tokenizer.json" in r.stderr and "--prompt-token-ids" in r.stderr


@pytest.mark.processes
def test_plan_reports_per_sequence_memory():
    from ouro.layers.context import ModelCache
    r = run_ouro("plan", "--model", "tiny", "--kv-cache-dtype", "float32", "--context", "1024")
    assert r.returncode == 0, r.stderr
    per_token = ModelCache.bytes_per_token(PRESETS["tiny"], torch.float32)
    assert f"per token (paged): {per_token:,} B" in r.stdout and "context     1,024" in r.stdout


@pytest.mark.processes
def test_plan_per_device_under_tp_and_cp():
    r = run_ouro("plan", "--model", "flash", "--context", "1048576", "--tp", "8", "--cp", "4", "--device-memory", "141GB")
    assert r.returncode == 0, r.stderr
    assert "tp 8 x cp 4 (32 devices)" in r.stdout and "such requests on a" in r.stdout and "all-MLA" in r.stdout
    bad = run_ouro("plan", "--model", "flash", "--device-memory", "lots")
    assert bad.returncode != 0 and "memory size" in bad.stderr
