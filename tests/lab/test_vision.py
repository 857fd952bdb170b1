"""`ouro probe vision`: the tower module by module and the image rows against transformers; a
clean run only informs, a dropped merger clamp is named at the merger, image rows written one
position late are named with their positions and the shift; every module and step transformers'
tower exposes is compared (the 2x2 merge, the patch projection, the merger's GELU, the attention
cores and SwiGLUs), and a fault inside the 2x2 merge is named there."""

from __future__ import annotations

import json
import subprocess
import sys

import os

import pytest
import torch

from tests.helpers.image_helpers import rows_one_position_late
from ouro.lab.faults.patch import applied_in_process
from ouro.lab.faults.scoring import score
from ouro.lab.faults import all_faults
from ouro.lab.numerics.vision import REFERENCE_INPUT_LAYOUT, load_reference, pictures, probe_vision, record, rel
from ouro.models.resolve import resolve_model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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


def test_every_module_and_step_of_the_reference_tower_is_compared():
    from ouro.models.image_processor import ImageProcessor
    from ouro.models.loader import load_vision
    d = resolve_model("tiny-vl", progress=False)
    tower, hf = load_vision(d).eval(), load_reference(d).model.visual
    pixels, grid = ImageProcessor.from_dir(d)(pictures(SIZES, 0))
    ours, ours_in, order, h1, steps = record(tower)
    theirs, theirs_in, _, h2, _ = record(hf, REFERENCE_INPUT_LAYOUT)
    with torch.no_grad():
        tower(pixels, grid)
        hf(pixels, grid_thw=grid)
    for h in h1 + h2:
        h.remove()
    # ouro runs every module transformers runs (its act_fn: inside the named SwiGLU step)
    missing = [n for n in theirs if n not in ours and not n.endswith(".act_fn")]
    assert not missing, missing
    for name in ("patch_embed.proj", "downsample", "merger.act1", "blocks.0.attn.attention_core",
                 "blocks.0.mlp.clamped_swiglu", "merger.clamped_swiglu"):
        assert name in order and rel(ours[name], theirs[name]) < 1e-5, name
        assert rel(ours_in[name], theirs_in[name]) < 1e-5, name   # inputs compared in one layout
    assert steps["blocks.0.attn.attention_core"] == "blocks.0.attn"


def test_a_fault_inside_the_2x2_merge_is_named_at_the_merge():
    fault = next(f for f in all_faults() if f.name == "vision_merge_block_transposed")
    assert fault.probes == [["vision", "--model", "tiny-vl"]]
    with applied_in_process(fault, REPO):
        found = probe_vision("tiny-vl", SIZES)
    s = score(found, fault.localised)
    assert s["detected"] and s["localised"], s["top"]
    assert s["top"]["where"]["module"] == "visual.downsample"
    assert s["top"]["where"]["function"] == "PatchDownsample.forward"


@pytest.mark.processes
@pytest.mark.slow       # each fault runs the probe in a patched copy of the package (the fault suite)
def test_the_planted_vision_faults_are_detected_and_localised(tmp_path):
    out = tmp_path / "faults.json"
    names = "vision_merger_clamp_dropped,image_rows_one_position_off,vision_merge_block_transposed"
    p = subprocess.run([sys.executable, "-m", "ouro.cli", "lab", "faults", "--only", names, "--no-clean",
                        "--json", str(out)],
                       capture_output=True, text=True, timeout=900)
    rows = {r["name"]: r for r in json.loads(out.read_text())["faults"]}
    for name, r in rows.items():
        assert not r["errors"] and r["detected"] and r["localised"], (name, r["top"], p.stdout[-2000:])
