"""The findings schema every probe shares: validation, ordering, bounded size, JSON round trip."""

import json

import pytest

from ouro.lab.findings import MAX_EVIDENCE_CHARS, Finding, format_table, read_json, sort_findings, write_json


def test_schema_rejects_unknown_severity_and_where_keys():
    with pytest.raises(ValueError, match="severity"):
        Finding("p", "fatal", "x")
    with pytest.raises(ValueError, match="where"):
        Finding("p", "info", "x", where={"filename": "a.py"})


def test_sorted_by_severity_keeping_each_probes_order():
    fs = [Finding("a", "info", "i1"), Finding("a", "warning", "w1"), Finding("a", "error", "e1"),
          Finding("a", "warning", "w2")]
    assert [f.summary for f in sort_findings(fs)] == ["e1", "w1", "w2", "i1"]


def test_evidence_is_bounded_and_json_round_trips(tmp_path):
    import torch
    big = Finding("p", "warning", "big", where={"file": "ouro/x.py", "function": "f", "line": 3},
                  measured=torch.tensor(0.5), expected=float("nan"), evidence={"rows": list(range(100000))})
    assert len(json.dumps(big.evidence)) <= MAX_EVIDENCE_CHARS + 100
    assert big.measured == 0.5 and big.expected == "nan"
    path = tmp_path / "f.json"
    write_json([Finding("p", "info", "small"), big], str(path))
    back = read_json(str(path))
    assert [f.summary for f in back] == ["big", "small"]
    assert back[0].where == {"file": "ouro/x.py", "function": "f", "line": 3}
    table = format_table(back)
    assert "ouro/x.py:3 f()" in table and "big" in table
