"""The agent's journal: one append-only JSONL file and one readable markdown log per run.

Each step records what the issue asks of it: the question, the hypothesis, the change (a diff),
the correctness result, the measurement, the decision, the next step, and the tokens and seconds
it used. Lines are only ever appended; `read` parses a run back (and says which line is broken,
if one is).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

FIELDS = ("question", "hypothesis", "change", "correctness", "measurement", "decision", "next", "tokens", "seconds")
DECISIONS = ("kept", "reverted", "parked", "refused", "none", "stopped")


class Journal:
    def __init__(self, directory, run_id: str):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.jsonl, self.md = self.dir / f"{run_id}.jsonl", self.dir / f"{run_id}.md"
        self.run_id = run_id
        if not self.md.exists():
            self.md.write_text(f"# Agent run {run_id}\n")

    def record(self, step: int, **entry) -> dict:
        unknown = set(entry) - set(FIELDS)
        if unknown:
            raise ValueError(f"journal fields are {', '.join(FIELDS)}; got {sorted(unknown)}")
        if entry.get("decision", "none") not in DECISIONS:
            raise ValueError(f"decision must be one of {', '.join(DECISIONS)}, got {entry['decision']!r}")
        row = {"run": self.run_id, "step": step, "time": time.time(), **{k: entry.get(k) for k in FIELDS}}
        with open(self.jsonl, "a") as f:
            f.write(json.dumps(row) + "\n")
        with open(self.md, "a") as f:
            f.write(f"\n## Step {step}: {row['decision'] or 'none'}\n")
            for k in FIELDS:
                v = row[k]
                if v in (None, ""):
                    continue
                text = v if isinstance(v, str) else json.dumps(v)
                f.write(f"\n**{k}**\n\n```\n{text}\n```\n" if k == "change" else f"- **{k}**: {text}\n")
        return row


def read(path) -> list[dict]:
    rows = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i} is not a JSON line: {e}") from None
    return rows
