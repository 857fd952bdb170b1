"""The redundancy probe: clean ouro gives no new warning; planted recomputation, host syncs, a
decode path that expands the MLA latent per head and a small block far above its floor are each
named by the top finding."""

import argparse
from pathlib import Path

import pytest
import torch

from ouro.lab.redundancy import probe as redundancy
from ouro.lab.findings import sort_findings, top_finding
from ouro.layers import dsa as dsa_layer
from ouro.layers import kda as kda_layer
from ouro.models.loader import load_model


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_model(tiny_checkpoint, dtype=torch.float32)


def probe(model):
    return sort_findings(redundancy.probe_model(model, prompt_len=24, context=48, batch=1))


def test_clean_ouro_has_no_error_and_no_wasted_work(model):
    # host syncs that ouro has today are real findings (warnings); wasted work there is none
    findings = probe(model)
    assert all(f.severity != "error" for f in findings)
    unexpected = [f for f in findings if f.severity == "warning" and "host sync" not in f.summary]
    assert not unexpected, [f.summary for f in unexpected]
    # the ops-per-module table and the floor table are always there
    assert any("aten ops dispatched per step" in f.summary for f in findings)
    assert any("against the floor per block" in f.summary for f in findings)


def test_recomputed_forget_gate_is_the_top_finding(model, monkeypatch, eager_reference):
    original = kda_layer.KDAttention.forget_gate

    def thrice(self, x, fa=None):
        for _ in range(2):
            original(self, x, fa)
        return original(self, x, fa)
    monkeypatch.setattr(kda_layer.KDAttention, "forget_gate", thrice)
    top = top_finding(probe(model))
    assert top.severity == "warning" and "recomputes" in top.summary, top.summary
    assert top.where["file"] == "ouro/layers/kda.py" and top.where["function"] == "forget_gate"
    assert top.where["module"].startswith("layers.0.self_attn")


def test_host_sync_planted_in_a_layer_decode_path_is_the_top_finding(model, monkeypatch, eager_reference):
    original = kda_layer.l2_normalize

    def with_sync(x, eps=1e-6):
        if x.shape[0] == 1:             # a decode row
            float(x.abs().max())       # .item() in disguise
        return original(x, eps)
    monkeypatch.setattr(kda_layer, "l2_normalize", with_sync)
    top = top_finding(probe(model))
    assert top.severity == "warning" and "host sync" in top.summary, top.summary
    assert top.where["file"] == "ouro/layers/kda.py" and top.where["function"] == "_forward"
    assert top.where["module"] == "layers.0.self_attn" and top.where["op"] == "item"


def _expanded_mla(q_nope, latents, selected, w_uk, w_uv, scale, block=256):
    """Correct but slow: K and V expanded per head for every cached latent row (no absorption)."""
    k = torch.einsum("lr,hdr->lhd", latents.float(), w_uk.float())
    v = torch.einsum("lr,hdr->lhd", latents.float(), w_uv.float())
    L = latents.shape[0]
    if selected is None:
        n = q_nope.shape[0]
        mask = torch.arange(L)[None, :] <= torch.arange(L - n, L)[:, None]
    else:
        mask = torch.zeros(q_nope.shape[0], L + 1, dtype=torch.bool)
        mask.scatter_(1, torch.where(selected < 0, L, selected), True)
        mask = mask[:, :L]
    scores = torch.einsum("nhd,lhd->nhl", q_nope.float(), k) * scale
    probs = scores.masked_fill(~mask[:, None, :], float("-inf")).softmax(-1)
    return torch.einsum("nhl,lhv->nhv", probs, v).to(q_nope.dtype)


def test_expanded_mla_decode_is_the_top_finding(model, monkeypatch, eager_reference):
    monkeypatch.setattr(dsa_layer, "sparse_mla", _expanded_mla)
    findings = probe(model)
    top = top_finding(findings)
    assert top.severity == "warning" and "floor" in top.summary, top.summary
    assert top.where["module"] == "layers.3.self_attn" and top.where["file"] == "ouro/layers/dsa.py"


def test_cli_run_depends_only_on_args(tiny_checkpoint):
    p = argparse.ArgumentParser()
    redundancy.add_arguments(p)
    findings = redundancy.run(p.parse_args(["--model", str(tiny_checkpoint), "--prompt-len", "8", "--context", "20"]))
    assert findings and all(f.probe == "redundancy" for f in findings)


def test_decode_work_growing_with_context_is_the_top_finding(model, monkeypatch, eager_reference):
    original = dsa_layer.DSAttention._forward

    def with_expansion(self, x, ctx, prev_selection=None):
        out = original(self, x, ctx, prev_selection)
        if ctx.is_decode:   # wasted: K/V per head for every context row (the absorbed form needs none)
            rows = dsa_layer.cache_rows(ctx, ctx.seq_index, torch.arange(ctx.context_len(0))[None])
            ctx.cache.latent[self.cache_index].view(-1, self.r)[rows] @ self.kv_b_proj.weight.T
        return out
    monkeypatch.setattr(dsa_layer.DSAttention, "_forward", with_expansion)
    top = top_finding(probe(model))
    assert top.severity == "warning" and "grows with context" in top.summary, top.summary
    assert top.where["module"] == "layers.3.self_attn" and top.where["op"] == "mm"


def test_far_above_floor_is_a_warning_whatever_its_share(monkeypatch):
    """A block at 5x its floor's work warns though its excess is 0.3% of the step; at 3.9x it does not."""
    from types import SimpleNamespace as NS
    from ouro.lab.redundancy import report
    from ouro.lab.redundancy.module_floor import BlockCost
    for ratio, severity in ((5.0, "warning"), (3.9, None)):
        rec = {"layers.0.mlp": BlockCost(bytes=1.5e6, core_bytes=1.5e6, ops=9),
               "layers.0.attn_hc": BlockCost(bytes=ratio * 1e3, core_bytes=ratio * 1e3, ops=9)}
        rec["layers.0.attn_hc"].top_core = rec["layers.0.attn_hc"].top_bytes = NS(
            frame=("ouro/layers/mhc.py", "forward", 30), module="layers.0.attn_hc", op="_to_copy", bytes=1e3,
            matmul_flops=0.0)
        monkeypatch.setattr(report, "recorded_by_block", lambda ops, rec=rec: rec)
        monkeypatch.setattr(report, "block_floors", lambda *a: {"layers.0.mlp": (0.0, 1e6), "layers.0.attn_hc": (0.0, 1e3)})
        steps = [NS(label=f"decode@{c}", context=c, ops=[], io_bytes={}) for c in (64, 256)]
        found = [f for f in report.floor_findings(None, steps, 1, redundancy.CostModel()) if f.severity == "warning"]
        assert [f.where["module"] for f in found] == (["layers.0.attn_hc"] if severity else []), [f.summary for f in found]


@pytest.mark.parametrize("batch", [1, 4])
def test_weight_copied_per_call_in_a_small_block_is_the_top_finding(model, batch, eager_reference):
    """The planted fault: each hyper-connection copies its projection weight to float64 per call,
    ~6.7x its floor's work (all bytes ~7x: under the 8x that the share-gated rule asks)."""
    from ouro.lab.faults.patch import applied_in_process
    from ouro.lab.faults.scoring import score
    from ouro.lab.faults import all_faults
    fault = {f.name: f for f in all_faults()}["hc_weight_through_float64"]
    with applied_in_process(fault, str(Path(__file__).resolve().parents[2])):
        found = sort_findings(redundancy.probe_model(model, prompt_len=24, context=48, batch=batch))
    s = score(found, fault.localised)
    assert s["detected"] and s["localised"], s["top"]
    top = top_finding(found)
    assert "floor's work" in top.summary and all("floor's work" in r for r in top.evidence["reasons"]), top.evidence


def test_clean_ouro_has_no_floor_warning_at_batch_4(model):
    findings = redundancy.probe_model(model, prompt_len=24, context=48, batch=4)
    assert not [f.summary for f in findings if f.severity != "info" and "floor" in f.summary]


def _planted(model, name, batch=1):
    from ouro.lab.faults.patch import applied_in_process
    from ouro.lab.faults import all_faults
    fault = {f.name: f for f in all_faults()}[name]
    with applied_in_process(fault, str(Path(__file__).resolve().parents[2])):
        return fault, sort_findings(redundancy.probe_model(model, prompt_len=24, context=48, batch=batch))


@pytest.mark.parametrize("gemm", [None, "packed"])
def test_every_expert_read_at_batch_1_is_the_top_finding(model, monkeypatch, gemm, eager_reference):
    """The planted fault reads all 8 experts' weights where the router chose 2: 4x the routed
    weights' floor, but 3.1x the MoE block's work (the shared expert and router are read once): a
    block total would miss it, the weight's own reads do not, whichever product forms this machine
    picked (`packed`: the projections read oneDNN copies, counted as their weights)."""
    from ouro.lab.faults.scoring import score
    if gemm:
        monkeypatch.setenv("OURO_GEMM_PICK", gemm)
    fault, found = _planted(model, "moe_decode_reads_all_experts")
    s = score(found, fault.localised)
    assert s["detected"] and s["localised"], s["top"]
    top = top_finding(found)
    assert top.where["module"].startswith("layers.") and top.where["module"].endswith(".mlp.experts"), top.where
    assert top.where["function"] == "_experts_gathered" and "experts.gate_up_proj 4.0x its floor" in top.summary, top.summary


@pytest.mark.parametrize("form", ["packed", "panels"])
def test_weight_reads_count_each_matrix_once_on_clean_decode(model, monkeypatch, form):
    """Clean batch-1 decode reads every weight matrix exactly its floor (the routed experts: the two
    chosen), through the parameter or its packed copy alike (oneDNN's, the panels)."""
    from ouro.lab.redundancy.module_floor import weight_reads
    monkeypatch.setenv("OURO_GEMM_PICK", form)
    steps = redundancy.record_steps(model, 24, (48,), 1)
    reads = weight_reads(model, steps[1].ops, 1)
    matrices = {n for n, p in model.named_parameters() if p.dim() >= 2}
    assert set(reads) == matrices
    assert {n: round(r / f, 6) for n, (r, f, _) in reads.items() if abs(r / f - 1) > 1e-9} == {}
    # the packed form ran: native's `packed_linear` on the weights themselves where it is built, else
    # oneDNN's op on packed copies
    from ouro.native import kernels, onednn
    if form == "panels":         # where it is not built, the form falls back to F.linear (`mm`)
        packed_op = "panel_linear" if kernels.load("panels") else "mm"
    else:
        packed_op = "packed_linear" if onednn.ready(next(model.parameters())) else "_linear_pointwise"
    assert any(op.op == packed_op for _, _, op in reads.values())


@pytest.fixture
def eager_reference():
    """Faults planted in the eager code (the fused native ops' reference) are looked for on the eager
    path; faults inside the native kernels: tests/lab/test_fused.py."""
    from ouro.native.kernels import eager_only
    with eager_only():
        yield


def test_the_fused_off_option_weighs_the_eager_reference():
    """`ouro probe redundancy --fused off` runs the steps on the eager code the fused ops keep as
    their reference: the planted all-experts read there is found with it and not without it (the
    fused experts op reads the chosen experts whatever that code does)."""
    from ouro.lab.faults.patch import applied_in_process
    from ouro.lab.faults.scoring import score
    from ouro.lab.faults import all_faults
    from ouro.native import kernels
    if not kernels.load("experts"):
        pytest.skip(f"no fused experts op here: {kernels.why_not('experts')}")
    fault = {f.name: f for f in all_faults()}["moe_decode_reads_all_experts"]
    assert fault.probes == [["redundancy", "--model", "tiny", "--fused", "off"]]
    with applied_in_process(fault, str(Path(__file__).resolve().parents[2])):
        off = redundancy.probe_redundancy("tiny", prompt_len=24, context=48, fused=False)
        on = redundancy.probe_redundancy("tiny", prompt_len=24, context=48, fused=True)
    assert score(off, fault.localised)["localised"]
    assert not score(on, fault.localised)["detected"]
