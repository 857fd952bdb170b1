"""The kernels probe: a clean ouro passes every correctness check and gets times, roofline shares
and step shares; a planted wrong kernel is an `error` naming it with no time; a planted slow
kernel is the top `warning`; a sweep interleaves its variants and gives an A/B verdict."""

import argparse
import json
import time

import pytest
import torch

import ouro.layers.context
import ouro.layers.kda
import ouro.layers.moe
from ouro.lab.kernels import probe as kernels
from ouro.lab.kernels.cases import CASES, DEFAULT_OPS
from ouro.lab.kernels.steps import amdahl


@pytest.fixture(scope="module")
def clean(tiny_checkpoint):
    report = []
    t0 = time.perf_counter()
    findings = kernels.probe_kernels(tiny_checkpoint, report=report)
    return findings, report, time.perf_counter() - t0


def test_clean_ouro_has_no_error_and_every_op_is_timed(clean):
    findings, report, seconds = clean
    assert not [f for f in findings if f.severity == "error"], [f.summary for f in findings if f.severity == "error"]
    timed = {(r["op"], r["phase"]) for r in report if r["correct"]}
    assert timed == {(c.name, p) for c in CASES.values() for p in c.phases}
    for r in report:
        assert r["median_s"] > 0 and r["floor_s"] > 0 and 0 < r["roofline_share"]
        assert 0 <= r["step_share"] <= 1
        assert r["bound_k2"] == pytest.approx(amdahl(r["step_share"], 2))
        assert r["bound_inf"] == pytest.approx(1 / (1 - r["step_share"]))
    # the ops the model runs are all seen inside its steps
    assert all(r["calls_per_step"] > 0 for r in report), [(r["op"], r["phase"]) for r in report if not r["calls_per_step"]]
    assert seconds < 60


def test_findings_are_local_and_ordered(clean):
    findings, _, _ = clean
    assert findings and all(f.probe == "kernels" for f in findings)
    for f in findings:
        assert f.where["file"].startswith("ouro/ops/") and f.where["function"] and f.where["op"]
    warnings = [f.measured["step_gain_at_floor"] for f in findings if f.severity == "warning"]
    assert warnings == sorted(warnings, reverse=True)          # the best Amdahl target first


def drop_last_chunk_state(real):
    """kda_chunk whose final state forgets the last chunk's update (outputs stay right)."""
    def wrong(q, k, v, g, beta, initial_state=None, chunk_size=16):
        o, _ = real(q, k, v, g, beta, initial_state, chunk_size)
        cut = (q.shape[1] - 1) // chunk_size * chunk_size
        _, s = real(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut], initial_state, chunk_size)
        return o, s
    return wrong


def test_planted_wrong_kernel_is_an_error_with_no_time(tiny_checkpoint, monkeypatch):
    import ouro.layers.context
    monkeypatch.setattr(ouro.layers.context, "kda_chunk", drop_last_chunk_state(ouro.layers.context.kda_chunk))
    report = []
    findings = kernels.probe_kernels(tiny_checkpoint, ops=["route", "kda_chunk"], report=report)
    top = findings[0]
    assert top.severity == "error"
    assert top.where["file"] == "ouro/ops/kda/chunk.py" and top.where["function"] == "kda_chunk"
    assert "kda_chunk" in top.where["op"] and "chunk=16" in top.where["op"]
    assert "final_state" in top.summary and top.measured["per_output"]["output"] < 1e-4   # which output is wrong
    assert [r for r in report if r["op"] == "kda_chunk"] == [
        {"op": "kda_chunk", "phase": "prefill", "params": {"chunk": 16}, "correct": False, "error": top.measured["error"]}]
    assert not any("kda_chunk" in f.summary and "ms per call" in f.summary for f in findings)   # no speed claim
    assert any(r["op"] == "route" and r["correct"] for r in report)                           # the rest still runs


def test_planted_selection_bug_in_decode(tiny_checkpoint, monkeypatch):
    """sparse_mla that ignores the indexer's selection (attends to every cached latent)."""
    import ouro.layers.dsa
    real = ouro.layers.dsa.sparse_mla
    monkeypatch.setattr(ouro.layers.dsa, "sparse_mla", lambda q, lat, sel, *a, **kw: real(q, lat, None, *a, **kw))
    findings = kernels.probe_kernels(tiny_checkpoint, ops=["sinkhorn", "sparse_mla"], step=False)
    assert [f.where["op"] for f in findings if f.severity == "error"] == ["sparse_mla[decode](block=256)"]
    assert findings[0].where["file"] == "ouro/ops/dsa/sparse_mla.py"


def test_planted_selection_bug_in_a_prefill_chunk(tiny_checkpoint, monkeypatch):
    """The prefill form that takes its selection as a causal mask only (every earlier token kept)."""
    import ouro.layers.dsa
    real = ouro.layers.dsa.sparse_mla_chunk

    def causal(q, lat, sel, *a, **kw):
        n, L = sel.shape[0], int(sel.max()) + 1
        everything = torch.arange(L).expand(n, L).masked_fill(torch.arange(L)[None] > sel.max(-1).values[:, None], -1)
        return real(q, lat, everything, *a, **kw)
    monkeypatch.setattr(ouro.layers.dsa, "sparse_mla_chunk", causal)
    findings = kernels.probe_kernels(tiny_checkpoint, ops=["sparse_mla_chunk"], step=False)
    assert [f.where["op"] for f in findings if f.severity == "error"] == ["sparse_mla_chunk[prefill](block=256)"]


def test_nan_and_crash_are_errors(tiny_checkpoint, monkeypatch):
    real = ouro.layers.moe.experts_grouped

    def leaves_a_row(x, *a, **kw):
        y = real(x, *a, **kw)
        y[-1] = float("nan")             # the last token's row never written
        return y
    monkeypatch.setattr(ouro.layers.moe, "experts_grouped", leaves_a_row)
    monkeypatch.setattr(ouro.layers.moe, "route", lambda *a, **kw: 1 / 0)
    findings = kernels.probe_kernels(tiny_checkpoint, ops=["experts_grouped", "route"], step=False)
    errors = {(f.where["function"], f.where["op"].split("[")[1][:-1]) for f in findings if f.severity == "error"}
    assert errors == {("experts_grouped", "prefill"), ("experts_grouped", "decode"), ("route", "prefill"), ("route", "decode")}
    assert any("ZeroDivisionError" in f.summary for f in findings)


def test_planted_slow_kernel_is_the_top_warning(tiny_checkpoint, monkeypatch):
    real = ouro.layers.moe.experts_grouped

    def slow(*a, **kw):
        time.sleep(0.03)                 # right, but far from any roofline and most of the step
        return real(*a, **kw)
    monkeypatch.setattr(ouro.layers.moe, "experts_grouped", slow)
    findings = kernels.probe_kernels(tiny_checkpoint, ops=["experts_grouped", "sinkhorn", "kda_chunk"], repeats=3)
    top = findings[0]
    assert top.severity == "warning" and top.where["function"] == "experts_grouped", [f.summary for f in findings]
    assert top.measured["step_share"] > 0.3 and top.measured["bound_inf"] > 1.4


def test_sweep_interleaves_and_flags_a_wrong_variant(tiny_checkpoint, monkeypatch):
    real = ouro.layers.context.kda_chunk

    def wrong_at_32(q, k, v, g, beta, initial_state=None, chunk_size=16):
        o, s = real(q, k, v, g, beta, initial_state, chunk_size)
        return (o * 1.01, s) if chunk_size == 32 else (o, s)
    monkeypatch.setattr(ouro.layers.context, "kda_chunk", wrong_at_32)
    report = []
    findings = kernels.probe_kernels(tiny_checkpoint, ops=["kda_chunk"], sweeps={"chunk": [16, 32, 8]},
                                     step=False, report=report)
    assert findings[0].severity == "error" and "chunk=32" in findings[0].where["op"]
    timed = {r["params"]["chunk"]: r for r in report if r["correct"]}
    assert set(timed) == {16, 8} and len(timed[16]["times"]) == len(timed[8]["times"]) >= 7
    sweep = [f for f in findings if "sweep" in f.summary]
    assert len(sweep) == 1
    v = sweep[0].measured["verdict"]
    assert v["verdict"] in ("faster", "slower", "no difference") and v["label_a"] == "(chunk=16)"
    assert sweep[0].measured["best"]["chunk"] in (16, 8)


def test_cli_run_and_json(tiny_checkpoint, tmp_path, capsys):
    from ouro.lab.findings import read_json, write_json
    p = argparse.ArgumentParser()
    kernels.add_arguments(p)
    args = p.parse_args(["--model", str(tiny_checkpoint), "--op", "route", "sinkhorn", "--no-step",
                         "--sweep", "chunk=16,32", "--repeats", "3"])
    assert args.op == ["route", "sinkhorn"] and kernels.parse_sweeps(args.sweep) == {"chunk": [16, 32]}
    findings = kernels.run(args)
    out = capsys.readouterr().out
    assert "route" in out and "sinkhorn" in out and "floor ms" in out
    write_json(findings, tmp_path / "k.json")
    assert len(read_json(tmp_path / "k.json")) == len(findings) == 4
    json.dumps([f.to_dict() for f in findings])
    assert torch.get_num_threads() >= 1


def test_default_op_set_covers_the_model_ops():
    assert set(DEFAULT_OPS) >= {"kda_chunk", "kda_recurrent_step", "causal_conv1d", "sparse_mla", "sparse_mla_chunk", "index_select",
                                "experts_grouped", "route", "sinkhorn"}
