"""The output head's product either way round: the same logits; the choice per row count by
measurement, cached per machine and shape; the pin; an engine built here uses the measured forms."""

import json

import pytest
import torch

from ouro import gemm_pick
from ouro.layers.output_head import OutputHead


def test_both_forms_give_the_same_logits_at_every_row_count():
    torch.manual_seed(0)
    head = OutputHead(48, 300, bias=False)
    torch.nn.init.normal_(head.weight)
    for rows in (1, 2, 4, 7, 16, 33):
        x = torch.randn(rows, 48)
        ref = x @ head.weight.T
        for forms in (["linear"] * 3, ["transposed"] * 3, ["linear", "transposed", "transposed"]):
            head.forms = forms
            out = head(x)
            assert out.shape == (rows, 300) and out.is_contiguous()
            err = ((out - ref).norm() / ref.norm()).item()
            assert err < 1e-6, (rows, forms, err)
    head.forms = None
    assert torch.equal(head(x), torch.nn.functional.linear(x, head.weight))


@pytest.mark.parametrize("rows, want", [(1, "linear"), (3, "linear"), (4, "transposed"), (15, "transposed"),
                                        (16, "linear"), (500, "linear")])
def test_form_follows_the_largest_measured_row_count_below(rows, want):
    assert gemm_pick.form_for(["linear", "transposed", "linear"], rows) == want


def test_rule_needs_a_clear_win():
    times = {"linear": [1.0, 2.0, 3.0], "transposed": [0.5, 1.9, 3.5]}
    assert gemm_pick.choose(times) == ["transposed", "linear", "linear"]


def test_measured_once_per_shape_and_pinned(monkeypatch, tmp_path):
    monkeypatch.delenv("OURO_GEMM_PICK", raising=False)
    monkeypatch.setenv("OURO_CACHE", str(tmp_path))
    calls = []

    def fake(form, weight, rows, budget_s=0.05):
        calls.append((form, rows))
        return {"linear": 2.0, "transposed": 1.0}[form] if rows > 1 else 1.0
    monkeypatch.setattr(gemm_pick, "time_form", fake)
    w = torch.zeros(64, 8)
    assert gemm_pick.pick_forms(w) == ["linear", "transposed", "transposed"]
    assert len(calls) == 2 * len(gemm_pick.ROWS)
    assert gemm_pick.pick_forms(w) == ["linear", "transposed", "transposed"] and len(calls) == 6   # cached
    gemm_pick.pick_forms(torch.zeros(65, 8))                   # another shape: measured
    assert len(calls) == 12
    saved = json.loads((tmp_path / "gemm_pick.json").read_text())
    assert len(saved) == 2 and all(len(v["forms"]) == len(gemm_pick.ROWS) for v in saved.values())
    monkeypatch.setenv("OURO_GEMM_PICK", "transposed")
    assert gemm_pick.pick_forms(w) == ["transposed"] * len(gemm_pick.ROWS)
    monkeypatch.setenv("OURO_GEMM_PICK", "sideways")
    with pytest.raises(ValueError, match="OURO_GEMM_PICK"):
        gemm_pick.pick_forms(w)


def test_engine_takes_the_measured_forms(monkeypatch, tmp_path):
    monkeypatch.delenv("OURO_GEMM_PICK", raising=False)
    monkeypatch.setenv("OURO_CACHE", str(tmp_path))
    from ouro.engine.llm import LLM
    from ouro.models.resolve import resolve_model
    llm = LLM(str(resolve_model("tiny")), max_memory=8 << 20)
    head = llm.engine.model.lm_head
    assert head.forms == gemm_pick.pick_forms(head.weight) and set(head.forms) <= set(gemm_pick.FORMS)
