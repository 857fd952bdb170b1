"""`ouro lab faults`: each planted fault is applied to a temporary copy of the checkout, the
probes a person would run for its symptom run there as real `ouro probe` processes, and the
result is scored (detected, localised, seconds to the finding). `--sparse` adds what sparse
feedback says about the same copy: the default test suite's verdict and the throughput change."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from ..call_trace import REPO_DIR
from .patch import Fault, apply_fault, copy_tree
from .scoring import score
from ..findings import Finding
from . import all_faults

BENCH = ["bench", "offline", "--model", "tiny", "--num-prompts", "8", "--input-len", "64", "--output-len", "16",
         "--max-concurrency", "8"]


def _env(root: str, extra: dict | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=root, OMP_WAIT_POLICY="PASSIVE", **(extra or {}))
    env.pop("OURO_TRACE", None)
    return env


def _run(cmd: list[str], root: str, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run in its own process group, so a timeout also stops what the run started (a probe's
    server, a test's engine process) instead of leaving it to spin."""
    p = subprocess.Popen(cmd, cwd=root, env=_env(root, env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def run_probe(root: str, args: list[str], timeout: float, baseline: str | None = None,
              out: str | None = None, env: dict | None = None) -> tuple[list[Finding], float, str | None]:
    """One `ouro probe` process against the copy at root (`env` added to its environment):
    (findings, seconds, error or None). With a baseline (the same probe's JSON on clean ouro,
    under the same `env`), what clean ouro also says is info."""
    out = out or os.path.join(root, f".probe-{args[0]}-{time.monotonic_ns()}.json")
    extra = ["--baseline", baseline] if baseline else []
    t0 = time.perf_counter()
    try:
        p = _run([sys.executable, "-m", "ouro.cli", "probe", *args, "--json", out, *extra], root, timeout, env)
    except subprocess.TimeoutExpired:
        return [], time.perf_counter() - t0, f"timed out after {timeout:.0f} s"
    seconds = time.perf_counter() - t0
    if p.returncode not in (0, 1) or not os.path.exists(out):
        return [], seconds, (p.stderr or p.stdout).strip().splitlines()[-1:] or [f"exit {p.returncode}"]
    with open(out) as f:
        return [Finding(**d) for d in json.load(f)["findings"]], seconds, None


def lab_tests(root: str) -> list[str]:
    tests = os.path.join(root, "tests", "lab")
    return sorted(f"tests/lab/{n}" for n in os.listdir(tests) if n.startswith("test_")) if os.path.isdir(tests) else []


def run_tests(root: str, timeout: float = 1800.0, selection: list[str] | None = None) -> dict:
    """The sparse baseline: the default test suite on the copy (or a selection of it), stopping
    at the first failure, without the lab's own tests (they are dense feedback: each probe checks
    clean ouro, and the fault suite's tests fail on a patched copy by construction)."""
    t0 = time.perf_counter()
    try:
        p = _run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *(selection or []),
                  *[f"--ignore={t}" for t in lab_tests(root)]], root, timeout)
    except subprocess.TimeoutExpired:
        return {"tests": "timeout", "tests_seconds": timeout}
    failed = [l.split(" ")[1] for l in p.stdout.splitlines() if l.startswith(("FAILED ", "ERROR "))]
    return {"tests": "pass" if p.returncode == 0 else "fail", "first_failure": failed[0] if failed else None,
            "tests_seconds": time.perf_counter() - t0}


def output_tok_s(root: str, timeout: float = 600.0) -> float | None:
    out = os.path.join(root, ".bench.json")
    try:
        p = _run([sys.executable, "-m", "ouro.cli", *BENCH, "--output-json", out], root, timeout)
    except subprocess.TimeoutExpired:
        return None
    if p.returncode != 0:
        return None
    with open(out) as f:
        return json.load(f)["ouro"]["output_tok_s"]


def _dsa_layers() -> set[int]:
    from ...models.presets import PRESETS
    return {i for i, t in enumerate(PRESETS["tiny"].layer_types) if t != "linear_attention"}


def probe_key(args: list[str], env: dict) -> tuple:
    """A probe command and the environment it runs under: one clean baseline each."""
    return (*args, *sorted(env.items()))


def run_fault(fault: Fault, workdir: str, timeout: float, sparse: bool = False, clean_root: str | None = None,
              baselines: dict | None = None) -> dict:
    root = copy_tree(REPO_DIR, os.path.join(workdir, fault.name))
    apply_fault(root, fault)
    findings, seconds, errors, first_detect = [], 0.0, [], None
    for args in fault.probes:
        f, s, err = run_probe(root, args, timeout, (baselines or {}).get(probe_key(args, fault.env)), env=fault.env)
        seconds += s
        findings += f
        if err:
            errors.append(f"{args[0]}: {err}")
        if first_detect is None and any(x.severity != "info" for x in f):
            first_detect = seconds
    row = {"name": fault.name, "description": fault.description, "breaks": f"{fault.file}:{fault.function}",
           "probes": [" ".join(a) for a in fault.probes], **score(findings, fault.localised, _dsa_layers()),
           "seconds": first_detect if first_detect is not None else seconds, "errors": errors}
    if sparse:
        row.update(run_tests(root))
        # clean, faulted, clean, faulted: the change is the ratio of the medians of each side
        runs = {"clean": [], "fault": []}
        for _ in range(2):
            for side, r in (("clean", clean_root), ("fault", root)):
                runs[side].append(output_tok_s(r))
        ok = {k: [x for x in v if x] for k, v in runs.items()}
        row["output_tok_s"] = {k: v for k, v in ok.items()}
        row["throughput_change"] = (statistics.median(ok["fault"]) / statistics.median(ok["clean"]) - 1
                                    if ok["fault"] and ok["clean"] else None)
    return row


def clean_baseline(faults: list[Fault], workdir: str, timeout: float) -> tuple[list[dict], dict]:
    """The same probe commands on an unpatched copy: what they say when nothing is broken. Their
    JSON is each faulted run's baseline, as a person compares a broken build with main."""
    root = copy_tree(REPO_DIR, os.path.join(workdir, "_clean"))
    rows, paths = [], {}
    for fault in faults:
        for args in fault.probes:
            key = probe_key(args, fault.env)
            if key in paths:
                continue
            paths[key] = os.path.join(workdir, f"clean-{len(paths)}.json")
            f, s, err = run_probe(root, args, timeout, out=paths[key], env=fault.env)
            if err:
                paths[key] = None
            standing = [x for x in f if x.severity != "info"]
            rows.append({"probe": " ".join(args) + "".join(f" [{k}={v}]" for k, v in sorted(fault.env.items())),
                         "standing": [f"{x.severity}: {x.summary}" for x in standing],
                         "seconds": s, "error": err})
    return rows, paths


def format_rows(rows: list[dict], sparse: bool) -> str:
    head = f"{'fault':<30} {'probe':<10} {'detected':<8} {'localised':<9} {'seconds':>7}"
    if sparse:
        head += f"  {'tests':<6} {'throughput':>10}"
    lines = [head]
    for r in rows:
        line = (f"{r['name']:<30} {r['probes'][0].split()[0]:<10} {str(r['detected']):<8} "
                f"{str(r['localised']):<9} {r['seconds']:>7.1f}")
        if sparse:
            ch = r.get("throughput_change")
            line += f"  {r.get('tests', '-'):<6} {('%+.0f%%' % (100 * ch)) if ch is not None else '-':>10}"
            if r.get("first_failure"):
                line += f"  {r['first_failure']}"
        lines.append(line)
        if r["top"]:
            lines.append(f"    top: [{r['top']['severity']}] {r['top']['summary'][:110]}")
        for e in r["errors"]:
            lines.append(f"    error: {e}")
    n = len(rows)
    det, loc = sum(r["detected"] for r in rows), sum(r["localised"] for r in rows)
    lines.append(f"\n{det}/{n} detected, {loc}/{n} localised by the top finding; "
                 f"slowest {max((r['seconds'] for r in rows), default=0):.1f} s")
    if sparse:
        missed = [r["name"] for r in rows if r.get("tests") == "pass"]
        lines.append(f"sparse feedback: the default tests fail for {n - len(missed)}/{n}; "
                     f"they miss: {', '.join(missed) or 'none'}")
    return "\n".join(lines)


def _write(path: str, rows: list[dict], baseline: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump({"faults": rows, "clean": baseline}, f, indent=1)


def run_suite(args) -> int:
    faults = all_faults()
    if args.list:
        for f in faults:
            print(f"{f.name:<30} {f.file}:{f.function}\n    {f.description}")
        return 0
    if args.only:
        names = args.only.split(",")
        unknown = set(names) - {f.name for f in faults}
        if unknown:
            raise ValueError(f"unknown fault(s) {sorted(unknown)}; `ouro lab faults --list` names them")
        by_name = {f.name: f for f in faults}
        faults = [by_name[n] for n in dict.fromkeys(names)]      # in the order given
    rows = []
    with tempfile.TemporaryDirectory(prefix="ouro-faults-") as work:
        clean = copy_tree(REPO_DIR, os.path.join(work, "_bench_clean")) if args.sparse else None
        baseline, paths = ([], {}) if args.no_clean else clean_baseline(faults, work, args.timeout)
        for fault in faults:
            rows.append(run_fault(fault, work, args.timeout, args.sparse, clean, paths))
            print(format_rows(rows[-1:], args.sparse).split("\n\n")[0], flush=True)
            if args.json:      # after every fault: a long --sparse run leaves usable partial results
                _write(args.json, rows, baseline)
    print("\n" + format_rows(rows, args.sparse))
    for b in baseline:   # what clean ouro itself is told: real findings, or false alarms to fix
        print(f"clean  {b['probe']} ({b['seconds']:.1f} s): "
              + ("; ".join(b["standing"]) if b["standing"] else "no warning")
              + (f"; error: {b['error']}" if b["error"] else ""))
    if args.json:
        _write(args.json, rows, baseline)
    ok = all(r["detected"] and r["localised"] for r in rows) and not any(b["error"] for b in baseline)
    return 0 if ok else 1
