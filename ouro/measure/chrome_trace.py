"""Chrome traces (the JSON Perfetto opens): merge the traces of several processes and read one
back as spans and heartbeat samples for the timeline's analysis. Standard library only."""

from __future__ import annotations

import json
import os


def load(path: str) -> dict:
    try:
        with open(path) as fh:
            doc = json.load(fh)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not a Chrome trace (JSON): {e}") from None
    if isinstance(doc, list):            # the bare-array form of the format
        doc = {"traceEvents": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise ValueError(f"{path} has no 'traceEvents' list: not a Chrome trace")
    return doc


def combine(event_lists: list[list[dict]]) -> dict:
    """One trace of several processes' events (one clock: CLOCK_MONOTONIC, so they line up)."""
    return {"traceEvents": [e for events in event_lists for e in events], "displayTimeUnit": "ms"}


def merge(paths: list[str], out: str) -> str:
    """Combine the traces that exist into the file `out`."""
    doc = combine([load(p)["traceEvents"] for p in paths if os.path.exists(p)])
    with open(out, "w") as fh:
        json.dump(doc, fh)
    return out


def spans_of(doc: dict) -> list[dict]:
    """Complete ('X') events as dicts: name, cat, start_ms, dur_ms, end_ms, pid, tid, thread."""
    names = {(e.get("pid"), e.get("tid")): e.get("args", {}).get("name")
             for e in doc["traceEvents"] if e.get("ph") == "M" and e.get("name") == "thread_name"}
    procs = {e.get("pid"): e.get("args", {}).get("name")
             for e in doc["traceEvents"] if e.get("ph") == "M" and e.get("name") == "process_name"}
    out = []
    for e in doc["traceEvents"]:
        if e.get("ph") != "X":
            continue
        start, dur = float(e["ts"]) / 1e3, float(e.get("dur", 0)) / 1e3
        pid, tid = e.get("pid"), e.get("tid")
        out.append({"name": e.get("name", "?"), "cat": e.get("cat", "misc"), "start_ms": start, "dur_ms": dur,
                    "end_ms": start + dur, "pid": pid, "tid": tid,
                    "thread": names.get((pid, tid)) or str(tid), "process": procs.get(pid) or str(pid)})
    return out


def heartbeats_of(doc: dict) -> dict:
    """Per pid: {'period_ms', 'samples': [(intended ms, delay ms)], 'late': [culprit samples]}."""
    out: dict = {}
    for e in doc["traceEvents"]:
        if e.get("cat") != "heartbeat":
            continue
        hb = out.setdefault(e.get("pid"), {"period_ms": 1.0, "samples": [], "late": []})
        if e.get("name") == "heartbeat_stats":
            hb["period_ms"] = e["args"].get("period_ms", 1.0)
            hb["samples"] += [tuple(s) for s in e["args"].get("samples", [])]
        elif e.get("name") == "heartbeat_late":
            hb["late"].append(e["args"])
    return out
