"""`ouro probe vision`: the tower module by module and the image rows against transformers; a
clean run only informs, a dropped merger clamp is named at the merger, image rows written one
position late are named with their positions and the shift."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from image_helpers import rows_one_position_late
from ouro.lab.vision_numerics import probe_vision

SIZES = [(60, 90), (90, 40)]


def test_a_clean_run_only_informs():
    findings = probe_vision("tiny-vl", SIZES)
    assert [f.severity for f in findings] == ["info", "info"], [f.summary for f in findings]
    assert "modules agree" in findings[0].summary and "input rows" in findings[1].summary


def test_a_dropped_merger_clamp_is_named_at_the_merger(monkeypatch):
    from ouro.models import loader
    real = loader.load_vision

    def unclamped(*a, **k):
        tower = real(*a, **k)
        tower.merger.limit = float("inf")
        return tower
    monkeypatch.setattr(loader, "load_vision", unclamped)
    top = probe_vision("tiny-vl", SIZES)[0]
    assert top.severity == "error" and top.where["module"].startswith("visual.merger"), top
    assert top.where["file"] == "ouro/models/vision.py" or top.where["file"].endswith("layers/vision.py")


def test_rows_one_position_late_are_named_with_the_shift(monkeypatch):
    rows_one_position_late(monkeypatch)
    findings = probe_vision("tiny-vl", SIZES)
    assert findings[0].severity == "info"                  # the tower itself is fine
    row = findings[1]
    assert row.severity == "error" and row.where["function"] == "image_rows" and "+1 position" in row.summary, row


@pytest.mark.slow       # each fault runs the probe in a patched copy of the package (the fault suite)
def test_the_planted_vision_faults_are_detected_and_localised(tmp_path):
    out = tmp_path / "faults.json"
    p = subprocess.run([sys.executable, "-m", "ouro.cli", "lab", "faults", "--only",
                        "vision_merger_clamp_dropped,image_rows_one_position_off", "--no-clean", "--json", str(out)],
                       capture_output=True, text=True, timeout=900)
    rows = {r["name"]: r for r in json.loads(out.read_text())["faults"]}
    for name, r in rows.items():
        assert not r["errors"] and r["detected"] and r["localised"], (name, r["top"], p.stdout[-2000:])
