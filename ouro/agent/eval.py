"""`ouro agent eval --faults`: the agent against the lab's planted faults. For each fault: a copy
of the checkout with the fault applied (its own git repository), a contract whose goal is the
fault's probe, an agent run within the limits, then the score on that copy with the run's final
patch applied: solved when the fault's probes no longer report anything clean ouro does not
(the lab's clean baseline) and the tests pass; with iterations, tokens and wall time.

`--feedback sparse` runs the same agent with only test pass/fail and end-to-end throughput, so
the value of the lab's dense feedback is a measured difference between two tables.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import tomllib
from pathlib import Path

from ..lab.call_trace import REPO_DIR
from ..lab.faults.patch import apply_fault, copy_tree
from ..lab.faults.suite import clean_baseline, run_probe, run_tests
from ..lab.faults import all_faults
from .contract import DEFAULT, Contract
from .loop import AgentRun


def fault_contract(fault, base: dict | None = None, tests: list[str] | None = None, limits: dict | None = None,
                   heldout: int | None = None, repeats: int | None = None) -> Contract:
    doc = json.loads(json.dumps(base or tomllib.loads(DEFAULT)))       # a deep copy
    doc["goal"] = {"kind": "probe", "probe": list(fault.probes[0]), "model": "tiny"}
    if tests is not None:
        doc.setdefault("checks", {})["tests"] = list(tests)
    if heldout is not None:
        doc.setdefault("checks", {})["heldout"] = heldout
    if repeats is not None:
        doc.setdefault("bench", {})["repeats"] = repeats
    doc.setdefault("limits", {}).update(limits or {})
    return Contract.from_dict(doc, f"the contract for fault {fault.name}")


def _git_init(root: str) -> None:
    for cmd in (["init", "-q"], ["add", "-A"],
                ["-c", "user.name=ouro eval", "-c", "user.email=eval@ouro.invalid", "commit", "-q", "-m", "faulted"]):
        subprocess.run(["git", *cmd], cwd=root, check=True, capture_output=True)


def evaluate_fault(fault, make_llm, workdir: str, feedback: str, contract: Contract, score_tests: list[str] | None,
                   baselines: dict, timeout: float, say=None) -> dict:
    root = copy_tree(REPO_DIR, os.path.join(workdir, fault.name))
    apply_fault(root, fault)
    _git_init(root)
    llm = make_llm()
    run = AgentRun(root, contract, llm, feedback=feedback, runs_dir=os.path.join(workdir, "runs"),
                   run_id=f"{fault.name}-{feedback}", say=say)
    out = run.run()
    patch = Path(out.final_patch)
    if patch.read_text():
        subprocess.run(["git", "apply", str(patch)], cwd=root, check=True)
    fires = []
    for args in fault.probes:
        findings, _, err = run_probe(root, args, timeout, baselines.get(tuple(args)))
        fires += [f"{f.severity}: {f.summary}" for f in findings if f.severity != "info"]
        if err:
            fires.append(f"error: {err}")
    tests = run_tests(root, selection=score_tests)
    solved = not fires and tests["tests"] == "pass"
    return {"fault": fault.name, "feedback": feedback, "solved": solved, "probe_fires": fires[:3],
            "tests": tests["tests"], "first_failure": tests.get("first_failure"), "iterations": out.iterations,
            "decisions": out.decisions, "parked": len(out.parked), "tokens": out.tokens, "seconds": out.seconds,
            "invalid_replies": out.invalid_replies, "ended": out.reason, "journal": os.path.join(out.run_dir,
                                                                                                  "journal.md")}


def run_eval(faults, make_llm, feedback: str = "dense", tests: list[str] | None = None,
             score_tests: list[str] | None = None, limits: dict | None = None, heldout: int | None = None,
             repeats: int | None = None, workdir: str | None = None, timeout: float = 300.0, say=None,
             base_contract: dict | None = None) -> list[dict]:
    """One row per fault. `tests` are the contract's checks during the run; `score_tests` the
    pytest selection scored at the end (None: the whole default suite without the lab's tests)."""
    own = workdir is None
    work = workdir or tempfile.mkdtemp(prefix="ouro-agent-eval-")
    _, paths = clean_baseline(faults, work, timeout)
    rows = []
    for fault in faults:
        contract = fault_contract(fault, base_contract, tests, limits, heldout, repeats)
        rows.append(evaluate_fault(fault, make_llm, work, feedback, contract, score_tests, paths, timeout, say))
    if own:
        for r in rows:
            r["workdir"] = work
    return rows


def format_rows(rows: list[dict]) -> str:
    head = f"{'fault':<30} {'feedback':<8} {'solved':<6} {'iters':>5} {'kept':>4} {'parked':>6} {'tokens':>8} {'seconds':>8}"
    lines = [head]
    for r in rows:
        lines.append(f"{r['fault']:<30} {r['feedback']:<8} {str(r['solved']):<6} {r['iterations']:>5} "
                     f"{r['decisions'].count('kept'):>4} {r['parked']:>6} {r['tokens']:>8} {r['seconds']:>8.1f}")
        if not r["solved"]:
            why = r["probe_fires"][:1] or [f"tests {r['tests']}: {r['first_failure']}"]
            lines.append(f"    unsolved: {why[0][:110]}; ended: {r['ended'][:80]}")
    n = len(rows)
    lines.append(f"\n{sum(r['solved'] for r in rows)}/{n} solved; {sum(r['tokens'] for r in rows)} tokens, "
                 f"{sum(r['seconds'] for r in rows):.0f} s in all")
    if rows:
        lines.append(f"journals: {os.path.dirname(os.path.dirname(rows[0]['journal']))}/*/journal.md")
    return "\n".join(lines)


def pick_faults(only: str | None):
    faults = all_faults()
    if not only:
        return faults
    by_name = {f.name: f for f in faults}
    unknown = [n for n in only.split(",") if n not in by_name]
    if unknown:
        raise ValueError(f"unknown fault(s) {unknown}; `ouro lab faults --list` names them")
    return [by_name[n] for n in dict.fromkeys(only.split(","))]
