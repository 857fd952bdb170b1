"""The tuning journal: one JSON line per candidate (its configuration, the correctness check, the
A/B verdict, kept or why not), appended as each finishes. A rerun with the same journal reads it
back and skips every candidate it already holds (the search takes the same path), so an
interrupted `ouro tune` resumes where it stopped. Its first line is the workload it was measured
on: a journal of another workload is refused, not mixed in."""

from __future__ import annotations

import json
from pathlib import Path


def key(config: dict) -> str:
    return json.dumps(config, sort_keys=True)


class Journal:
    def __init__(self, path, workload: dict | None = None):
        self.path = Path(path)
        self.entries: dict[str, dict] = {}
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                if line.strip():
                    e = json.loads(line)
                    self.entries[e["key"]] = e
        if workload is not None:
            had = self.get("workload", {})
            if had is None:
                self.add("workload", {}, {"workload": workload})
            elif had["workload"] != json.loads(json.dumps(workload)):
                raise ValueError(f"journal {self.path} holds candidates measured on another workload "
                                 f"({had['workload']}, not {workload}): pass another --journal, or delete it")

    def get(self, phase: str, config: dict) -> dict | None:
        return self.entries.get(f"{phase} {key(config)}")

    def add(self, phase: str, config: dict, entry: dict) -> dict:
        entry = dict(entry, key=f"{phase} {key(config)}", phase=phase, config=config)
        self.entries[entry["key"]] = entry
        with self.path.open("a") as f:
            f.write(json.dumps(entry) + "\n")
        return entry

    def in_order(self, phase: str) -> list[dict]:
        return [e for e in self.entries.values() if e["phase"] == phase]
