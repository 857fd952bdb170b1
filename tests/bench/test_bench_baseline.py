"""`ouro bench offline --baseline REF`: a git ref of this repository runs the same workload in its
own worktree and process, interleaved with the current tree; the worktree is removed afterwards."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ouro.bench.baseline import SOURCE_ROOT, BaselineError, bench_baseline, format_baseline, resolve_ref
from ouro.models.resolve import resolve_model

pytestmark = pytest.mark.skipif(not (SOURCE_ROOT / ".git").exists(), reason="needs a git checkout")


def worktrees():
    return subprocess.run(["git", "worktree", "list"], cwd=SOURCE_ROOT, capture_output=True, text=True).stdout


@pytest.mark.processes
@pytest.mark.slow
def test_baseline_head_runs_both_sides_and_cleans_up():
    before = worktrees()
    flags = ["--num-prompts", "2", "--input-len", "16", "--output-len", "4", "--max-concurrency", "2",
             "--device", "cpu", "--dtype", "float32"]
    r = bench_baseline("HEAD", str(resolve_model("tiny")), flags, repeats=1, progress=False)
    assert r["commit"] == resolve_ref("HEAD") and r["dtype"] == "float32"
    assert len(r["runs"]["baseline"]) == len(r["runs"]["current"]) == 1
    assert all(x["seconds"] > 0 for v in r["runs"].values() for x in v)
    assert r["speedup"] == pytest.approx(r["median_s"]["baseline"] / r["median_s"]["current"])
    assert "not judged" in r["verdict"]["verdict"]          # one run a side: no verdict claimed
    assert "speed-up" in format_baseline(r)
    assert worktrees() == before                            # the temporary worktree is gone


@pytest.mark.processes
def test_bad_ref_is_one_clear_line():
    with pytest.raises(BaselineError, match="not a commit"):
        resolve_ref("no-such-ref-anywhere")
    done = subprocess.run([sys.executable, "-m", "ouro.cli", "bench", "offline", "--baseline", "no-such-ref"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "not a commit" in done.stderr and "Traceback" not in done.stderr


def test_sides_run_as_a_users_own_bench(monkeypatch, tmp_path):
    """The CLI's PASSIVE OpenMP default (made both sides 1.6-1.8x slower) does not reach the sides;
    a user's own setting does; the baseline gets its own choice cache and none of this tree's pins."""
    from ouro.bench.baseline import side_env
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("OURO_SET_OMP_WAIT_POLICY", "1")
    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")
    monkeypatch.setenv("OURO_SET_GOMP_SPINCOUNT", "1")
    monkeypatch.setenv("OURO_GEMM_PICK", "packed")
    env = side_env(tmp_path)
    assert "OMP_WAIT_POLICY" not in env and "OURO_SET_OMP_WAIT_POLICY" not in env
    assert "GOMP_SPINCOUNT" not in env and "OURO_SET_GOMP_SPINCOUNT" not in env
    assert env["OURO_GEMM_PICK"] == "packed" and env["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path)
    base = side_env(tmp_path, own_cache=str(tmp_path / "own"))
    assert base["OURO_CACHE"] == str(tmp_path / "own") and "OURO_GEMM_PICK" not in base
    monkeypatch.delenv("OURO_SET_OMP_WAIT_POLICY")           # the user chose PASSIVE: kept
    assert side_env(tmp_path)["OMP_WAIT_POLICY"] == "PASSIVE"


def test_an_older_tree_gets_the_layer_types_in_the_spelling_it_knows(tmp_path):
    """Presets write the GLM checkpoint's "deepseek_sparse_attention"; the first engine knew only
    "indexed_attention": its side reads a linked copy whose config says so, nothing else changed."""
    import json

    from ouro.bench.baseline import older_checkpoint
    src = tmp_path / "ckpt"
    src.mkdir()
    config = {"model_type": "glm5_next", "text_config": {
        "model_type": "glm5_next_text", "layer_types": ["linear_attention", "deepseek_sparse_attention"], "x": 1}}
    (src / "config.json").write_text(json.dumps(config))
    (src / "model.safetensors").write_bytes(b"weights")
    out = older_checkpoint(src, tmp_path / "older")
    got = json.loads((out / "config.json").read_text())
    assert got["text_config"]["layer_types"] == ["linear_attention", "indexed_attention"]
    assert got["text_config"]["x"] == 1 and (out / "model.safetensors").read_bytes() == b"weights"
    assert json.loads((src / "config.json").read_text()) == config          # the original untouched
    config["text_config"]["layer_types"] = ["linear_attention", "indexed_attention"]
    (src / "config.json").write_text(json.dumps(config))
    assert older_checkpoint(src, tmp_path / "again") == src                 # nothing to respell: as it is


@pytest.mark.parametrize("given, want", [
    ({}, {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1000"}),
    ({"GOMP_SPINCOUNT": "7"}, {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "7"}),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": None}),
])
def test_the_cli_lets_idle_threads_sleep_after_a_short_spin(given, want):
    """The processes the CLI starts (`ouro serve`'s engine process among them) sleep idle OpenMP
    threads, after a short spin (none at all made a compiled batch-1 step 1.46x slower); a user's own
    settings stand."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OURO_SET_OMP_WAIT_POLICY", "OURO_SET_GOMP_SPINCOUNT")}
    code = ("import json, os, ouro.cli; print(json.dumps({k: os.environ.get(k) for k in "
            "('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT')}))")
    done = subprocess.run([sys.executable, "-c", code], env={**env, **given}, capture_output=True, text=True,
                          timeout=120, cwd=str(Path(__file__).resolve().parents[2]))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == want
