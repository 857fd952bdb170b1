"""The benchmarks run end to end on the tiny preset and report what they promise."""

import json
import os
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from ouro.models.presets import make_model
    d = tmp_path_factory.mktemp("tiny_bench")
    make_model("tiny", d, progress=False)
    return d


def test_offline_bench_json(tiny_dir, tmp_path):
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "ouro.cli", "bench", "offline", "--model", str(tiny_dir),
                        "--num-prompts", "6", "--input-len", "24", "--output-len", "5", "--max-concurrency", "3",
                        "--compare", "transformers", "--output-json", str(out)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["ratio"] > 0 and res["same_tokens"] == 1.0   # greedy outputs agree with transformers
    assert res["ouro"]["output_tok_s"] > 0 and res["transformers"]["output_tok_s"] > 0
    assert res["decode_floor"]["floor_s"] > 0 and res["prefill"]["over_floor"] > 0
    assert "ratio (output tok/s, ouro / transformers)" in r.stdout


def test_prefill_bench(tiny_dir):
    from ouro.bench.prefill import bench_prefill, format_prefill
    res = bench_prefill(tiny_dir, input_len=40, repeats=1, compare=True, progress=False)
    assert res["ouro_s"] > 0 and res["transformers_s"] > 0 and res["floor_s"] > 0
    assert "speed-up" in format_prefill(res)
