"""Scoring a probe run against a planted fault: detected (some finding of severity warning or
worse) and localised (the top finding's `where` matches one of the fault's expected places)."""

from __future__ import annotations

import re

from ..findings import Finding, sort_findings


def _match_one(where: dict, spec: dict, dsa_layers: set[int]) -> bool:
    for key, want in spec.items():
        have = where.get(key)
        if have is None:
            return False
        if key == "file":
            if not str(have).endswith(want) and not str(want).endswith(str(have)):
                return False
        elif key == "function":
            names = want if isinstance(want, (list, tuple)) else [want]
            if str(have).split(".")[-1] not in names:
                return False
        elif key == "layer":
            if want == "dsa":
                if int(have) not in dsa_layers:
                    return False
            elif int(have) != int(want):
                return False
        elif not re.fullmatch(str(want), str(have)) and not re.search(f"(^|[.:/ ]){want}", str(have)):
            return False
    return True


def localises(finding: Finding | None, expected: list[dict], dsa_layers: set[int] = frozenset()) -> bool:
    """The finding's `where` names one of the expected places. A spec's keys must all match:
    `file` by path suffix, `function` by name, `module`/`op`/`thread` by regex, `layer` by index
    (or "dsa": any DSA layer)."""
    if finding is None or not finding.where:
        return False
    return any(_match_one(finding.where, spec, dsa_layers) for spec in expected)


def score(findings: list[Finding], expected: list[dict], dsa_layers: set[int] = frozenset()) -> dict:
    ranked = sort_findings(findings)
    top = ranked[0] if ranked else None
    detected = any(f.severity in ("warning", "error") for f in ranked)
    return {"detected": detected, "localised": detected and localises(top, expected, dsa_layers),
            "top": None if top is None else {"probe": top.probe, "severity": top.severity,
                                             "summary": top.summary, "where": top.where}}
