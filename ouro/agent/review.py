"""`ouro agent review`: a person's gate. Lists each run's final patch and its parked changes (the
ones in a risk class) with their evidence, and applies or drops them. Applying is `git apply` in
the user's tree, the only place the agent's work ever reaches it; nothing is committed."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path


def runs_dir(repo) -> Path:
    return Path(repo) / "runs" / "agent"


def latest_run(repo) -> Path:
    runs = sorted(p for p in runs_dir(repo).glob("*") if (p / "journal.jsonl").exists())
    if not runs:
        raise ValueError(f"no agent runs under {runs_dir(repo)}: start one with `ouro agent run`")
    return runs[-1]


def parked(run: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((run / "parked").glob("*.json"), key=lambda p: int(p.stem))]


def show(run: Path) -> str:
    lines = [f"run {run.name} ({run})"]
    outcome = run / "outcome.json"
    if outcome.exists():
        o = json.loads(outcome.read_text())
        lines.append(f"ended: {o['reason']}; {o['iterations']} submissions, decisions {o['decisions']}, "
                     f"{o['tokens']} tokens, {o['seconds']} s")
    final = run / "final.patch"
    text = final.read_text() if final.exists() else ""
    lines.append(f"\nfinal patch (the kept changes): {'empty' if not text else f'{len(text.splitlines())} lines'}"
                 + ("; `ouro agent review --apply final` applies it" if text else ""))
    for p in parked(run):
        lines += [f"\n#{p['id']} [{p['status']}] risk: {', '.join(p['risk'])}; files: {', '.join(p['files'])}",
                  f"  why: {p.get('hypothesis') or p.get('summary')}",
                  f"  correctness: {json.dumps(p['correctness'].get('tests'))}, held-out "
                  f"{'passed' if p['correctness'].get('heldout', {}).get('passed') else 'failed'}",
                  f"  measurement: {p['measurement'].get('progress')}",
                  (run / "parked" / f"{p['id']}.patch").read_text()]
    return "\n".join(lines)


def park(run: Path, diff: str, evidence: dict) -> int:
    """Keep a change in a risk class for a person: its patch and its evidence, as #N of the run."""
    d = Path(run) / "parked"
    d.mkdir(parents=True, exist_ok=True)
    n = len(list(d.glob("*.json"))) + 1
    (d / f"{n}.patch").write_text(diff)
    (d / f"{n}.json").write_text(json.dumps({"id": n, "status": "parked", **evidence}, indent=1))
    return n


def _git_apply(repo, patch: Path) -> None:
    check = subprocess.run(["git", "apply", "--check", str(patch)], cwd=repo, capture_output=True, text=True)
    if check.returncode:
        raise ValueError(f"{patch} does not apply to {repo}: {check.stderr.strip()} (a parked change is relative to "
                         "the run's kept state: apply the final patch first)")
    subprocess.run(["git", "apply", str(patch)], cwd=repo, check=True)


def apply(repo, run: Path, which: str) -> str:
    if which == "final":
        patch = run / "final.patch"
        if not patch.exists() or not patch.read_text():
            return "the final patch is empty: nothing was kept"
        _git_apply(repo, patch)
        return f"applied {patch} to {repo} (not committed)"
    doc = _parked_doc(run, which)
    if doc["status"] != "parked":
        raise ValueError(f"#{which} is {doc['status']} already")
    _git_apply(repo, run / "parked" / f"{which}.patch")
    _set_status(run, doc, "applied")
    return f"applied parked change #{which} ({', '.join(doc['risk'])}) to {repo} (not committed)"


def drop(run: Path, which: str) -> str:
    doc = _parked_doc(run, which)
    if doc["status"] != "parked":
        raise ValueError(f"#{which} is {doc['status']} already")
    _set_status(run, doc, "dropped")
    return f"dropped parked change #{which}"


def _parked_doc(run: Path, which: str) -> dict:
    path = run / "parked" / f"{which}.json"
    if not path.exists():
        known = [str(p["id"]) for p in parked(run)]
        raise ValueError(f"run {run.name} has no parked change #{which}; it has: {', '.join(known) or 'none'}")
    return json.loads(path.read_text())


def _set_status(run: Path, doc: dict, status: str) -> None:
    doc["status"] = status
    (run / "parked" / f"{doc['id']}.json").write_text(json.dumps(doc, indent=1))
