"""`ouro bench offline --baseline REF`: the same offline workload on a git ref of this repository
and on the current tree, each in its own process, interleaved, medians over repeats.

The ref is checked out into a temporary `git worktree` (removed afterwards); each run is
`python -m ouro.cli bench offline ... --compare none --output-json` with that tree first on
`PYTHONPATH`, so each side imports its own ouro. Both sides read the same checkpoint directory
(resolved by the current tree) in the same explicit dtype. Repeats alternate which side goes
first (ABBA), so a drift in machine load falls on both."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ..measure.ab import verdict_from_times

SOURCE_ROOT = Path(__file__).resolve().parents[2]      # holds ouro/


class BaselineError(ValueError):    # the CLI prints it as one line
    pass


def _git(*args, cwd=SOURCE_ROOT) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise BaselineError("--baseline needs git on PATH") from None
    if done.returncode != 0:
        raise BaselineError(f"git {' '.join(args)}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip()


def resolve_ref(ref: str) -> str:
    if not (SOURCE_ROOT / ".git").exists():
        raise BaselineError(f"--baseline needs ouro run from a git checkout; {SOURCE_ROOT} is not one "
                            "(install with `pip install -e .` from a clone)")
    try:
        return _git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    except BaselineError:
        raise BaselineError(f"--baseline {ref!r} is not a commit of {SOURCE_ROOT} "
                            "(try a hash from `git log --oneline`)") from None


def side_env(tree: Path, own_cache: str | None = None) -> dict:
    """The environment of one side's process: ouro imported from `tree`; OpenMP's wait policy as
    the user had it (not the PASSIVE the CLI sets for the processes it starts); for the baseline,
    its own choice cache and none of this tree's pins."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    for marker, name in (("OURO_SET_OMP_WAIT_POLICY", "OMP_WAIT_POLICY"), ("OURO_SET_GOMP_SPINCOUNT", "GOMP_SPINCOUNT")):
        if env.pop(marker, None):
            env.pop(name, None)
    if own_cache is not None:
        env["OURO_CACHE"] = own_cache
        env.pop("OURO_GEMM_PICK", None)
    return env


def run_side(tree: Path, model_dir: str, flags: list[str], out_json: Path, timeout_s: float,
             own_cache: str | None = None) -> dict:
    """One `ouro bench offline` in its own process, importing ouro from `tree`. `own_cache`: the
    baseline's machine-choice cache, apart from this tree's (another version of ouro may store
    other choices under the same names), and without this tree's pins, which it may not know."""
    env = side_env(tree, own_cache)
    cmd = [sys.executable, "-m", "ouro.cli", "bench", "offline", "--model", model_dir, *flags,
           "--compare", "none", "--output-json", str(out_json)]
    try:
        done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise BaselineError(f"the run in {tree} took over {timeout_s:.0f} s: {' '.join(cmd)}") from None
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-8:])
        raise BaselineError(f"the run in {tree} failed (exit {done.returncode}):\n{tail}")
    r = json.loads(out_json.read_text())
    return {"seconds": r["ouro"]["seconds"], "output_tok_s": r["ouro"]["output_tok_s"],
            "decode_step_s": r["ouro"].get("decode_step_s"), "dtype": r.get("dtype")}


def older_checkpoint(model_dir: Path, out: Path) -> Path:
    """The checkpoint as an older tree reads it: the same files (linked), its config.json with the
    layer types in the canonical spelling (a GLM checkpoint's "deepseek_sparse_attention", which
    presets now write, is "indexed_attention" to every ouro; the first engine knew only that)."""
    from ..config.model import LAYER_TYPE_SPELLINGS
    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config") or config
    types = text.get("layer_types")
    if not types or not any(t in LAYER_TYPE_SPELLINGS for t in types):
        return model_dir
    text["layer_types"] = [LAYER_TYPE_SPELLINGS.get(t, t) for t in types]
    out.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f.resolve())
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def bench_baseline(ref: str, model_dir: str, flags: list[str], repeats: int = 3, timeout_s: float = 1800,
                   progress: bool = True, current_extra: list[str] = ()) -> dict:
    """flags: the offline workload's flags (--num-prompts ... --dtype D), the same for both sides;
    current_extra: flags only the current tree knows (--compile)."""
    from tqdm import tqdm
    commit = resolve_ref(ref)
    work = Path(tempfile.mkdtemp(prefix="ouro-baseline-"))
    tree = work / "tree"
    _git("worktree", "add", "--detach", str(tree), commit)
    sides = {"baseline": [], "current": []}
    try:
        from ..machine_cache import cache_root
        own = str(cache_root() / f"baseline-{commit[:12]}")
        older = older_checkpoint(Path(model_dir), work / "checkpoint")
        order = [("baseline", tree, [], own, older), ("current", SOURCE_ROOT, list(current_extra), None, model_dir)]
        bar = tqdm(total=2 * repeats, desc=f"baseline {commit[:7]} vs current", disable=not progress)
        for i in range(repeats):
            for name, root, extra, cache, ckpt in (order if i % 2 == 0 else order[::-1]):
                sides[name].append(run_side(root, str(ckpt), flags + extra, work / f"{name}-{i}.json", timeout_s, cache))
                bar.update(1)
        bar.close()
    finally:
        try:
            _git("worktree", "remove", "--force", str(tree))
        except BaselineError:
            pass
        shutil.rmtree(work, ignore_errors=True)
        try:
            _git("worktree", "prune")
        except BaselineError:
            pass
    base_t = [r["seconds"] for r in sides["baseline"]]
    cur_t = [r["seconds"] for r in sides["current"]]
    verdict = verdict_from_times(base_t, cur_t, f"baseline {commit[:7]}", "current")
    if repeats < 3:                    # one or two runs a side give no interval worth the name
        verdict.verdict = "not judged (--repeats 3 or more for a verdict)"
    med = {k: statistics.median(r["seconds"] for r in v) for k, v in sides.items()}
    step = {k: statistics.median([r["decode_step_s"] for r in v if r["decode_step_s"]] or [float("nan")])
            for k, v in sides.items()}
    return {"ref": ref, "commit": commit, "repeats": repeats, "current_flags": list(current_extra), "runs": sides, "median_s": med,
            "decode_step_s": step, "speedup": med["baseline"] / med["current"], "verdict": verdict.to_dict(),
            "dtype": sides["current"][0]["dtype"]}


def format_baseline(r: dict) -> str:
    v = r["verdict"]
    return "\n".join([
        f"baseline {r['ref']} ({r['commit'][:7]}) vs current tree, {r['dtype']}, {r['repeats']} repeats each, "
        "interleaved, each run in its own process:",
        f"  baseline  median {r['median_s']['baseline']:.2f} s  ("
        + ", ".join(f"{x['seconds']:.2f}" for x in r["runs"]["baseline"]) + ")"
        f"  decode step {1e3 * r['decode_step_s']['baseline']:.1f} ms",
        f"  current   median {r['median_s']['current']:.2f} s  ("
        + ", ".join(f"{x['seconds']:.2f}" for x in r["runs"]["current"]) + ")"
        f"  decode step {1e3 * r['decode_step_s']['current']:.1f} ms",
        f"  speed-up (baseline s / current s): {r['speedup']:.2f}x; A/B verdict: current is {v['verdict']} "
        f"(time ratio {v['ratio']:.3f}, interval {v['low']:.3f}..{v['high']:.3f})"])
