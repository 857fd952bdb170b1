"""One schema for every probe's findings: what was seen, where, measured against what, the
evidence, and the cheapest next step that would confirm it."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

SEVERITIES = ("info", "warning", "error")
WHERE_KEYS = ("file", "function", "line", "module", "layer", "op", "positions", "thread", "interval")
MAX_EVIDENCE_CHARS = 4000     # a finding is read by people and an LLM: no megabyte dumps
MAX_FINDINGS = 200


@dataclass
class Finding:
    probe: str
    severity: str
    summary: str
    where: dict = field(default_factory=dict)
    measured: Any = None
    expected: Any = None
    evidence: Any = None
    next: str = ""

    def __post_init__(self):
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")
        unknown = set(self.where) - set(WHERE_KEYS)
        if unknown:
            raise ValueError(f"unknown 'where' keys {sorted(unknown)}; allowed: {WHERE_KEYS}")
        self.where = {k: self.where[k] for k in WHERE_KEYS if self.where.get(k) is not None}
        self.measured, self.expected = _plain(self.measured), _plain(self.expected)
        self.evidence = _bounded(_plain(self.evidence))

    @property
    def rank(self) -> int:
        return SEVERITIES.index(self.severity)

    def to_dict(self) -> dict:
        return asdict(self)

    def where_text(self) -> str:
        w = self.where
        parts = []
        if "file" in w:
            parts.append(w["file"] + (f":{w['line']}" if "line" in w else "") + (f" {w['function']}()" if "function" in w else ""))
        elif "function" in w:
            parts.append(f"{w['function']}()")
        for k in ("module", "layer", "op", "positions", "thread", "interval"):
            if k in w:
                v = w[k]
                if isinstance(v, (list, tuple)) and len(v) == 2:
                    v = f"{v[0]}..{v[1]}"
                parts.append(f"{k}={v}")
        return " ".join(parts)


def _plain(x):
    """JSON-able copy: tensors and numpy scalars become numbers or lists, NaN stays visible."""
    if hasattr(x, "tolist") and not isinstance(x, (list, tuple)):
        x = x.tolist()
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


def _bounded(x):
    text = json.dumps(x, default=str)
    if len(text) <= MAX_EVIDENCE_CHARS:
        return x
    return {"truncated": text[:MAX_EVIDENCE_CHARS], "full_chars": len(text)}


def sort_findings(findings: list[Finding]) -> list[Finding]:
    """Most severe first; a stable sort keeps each probe's own order (its best guess first)."""
    return sorted(findings, key=lambda f: -f.rank)[:MAX_FINDINGS]


def finding_key(f: Finding) -> tuple:
    """What makes two runs' findings the same finding: probe, place and kind (not the numbers,
    not the line, which moves as code changes)."""
    w = f.where
    kind = f.summary.split(":", 1)[-1].split("(")[0]
    kind = "".join(c for c in kind if not c.isdigit() and c not in ".,%")
    return f.probe, w.get("file"), w.get("function"), w.get("module"), w.get("op"), w.get("thread"), kind.strip()


def apply_baseline(findings: list[Finding], baseline: list[Finding]) -> list[Finding]:
    """Findings a known-good run also made are kept, as info marked 'in baseline': what is left
    at warning or error is what changed."""
    known = {finding_key(b) for b in baseline if b.severity != "info"}
    out = []
    for f in findings:
        if f.severity != "info" and finding_key(f) in known:
            f = Finding(f.probe, "info", f"[in baseline, was {f.severity}] {f.summary}", f.where, f.measured,
                        f.expected, f.evidence, f.next)
        out.append(f)
    return out


def top_finding(findings: list[Finding]) -> Finding | None:
    s = sort_findings(findings)
    return s[0] if s else None


def format_table(findings: list[Finding], width: int = 120) -> str:
    if not findings:
        return "no findings"
    rows = [("severity", "probe", "where", "summary")]
    for f in sort_findings(findings):
        rows.append((f.severity, f.probe, f.where_text(), f.summary))
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    w2 = min(max(len(r[2]) for r in rows), 60)
    lines = []
    for r in rows:
        lines.append(f"{r[0]:<{w0}}  {r[1]:<{w1}}  {r[2][:w2]:<{w2}}  {r[3]}"[:width * 2])
    detail = []
    for f in sort_findings(findings):
        if f.severity == "info":
            continue
        detail.append(f"- [{f.severity}] {f.summary}\n  where: {f.where_text() or '-'}\n"
                      f"  measured: {_short(f.measured)}  expected: {_short(f.expected)}"
                      + (f"\n  next: {f.next}" if f.next else ""))
    return "\n".join(lines + ([""] + detail if detail else []))


def _short(x, n: int = 160) -> str:
    s = json.dumps(x, default=str)
    return s if len(s) <= n else s[:n] + "..."


def write_json(findings: list[Finding], path: str, extra: dict | None = None) -> None:
    doc = {"findings": [f.to_dict() for f in sort_findings(findings)]}
    if extra:
        doc.update(extra)
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1, default=str)


def read_json(path: str) -> list[Finding]:
    """A findings file (`--json`'s output); a ValueError naming the file where it is not one."""
    try:
        with open(path) as fh:
            return [Finding(**d) for d in json.load(fh)["findings"]]
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror or e})") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a findings file (from --json): {e}") from None
