"""The redundancy probe: clean ouro gives no new warning; planted recomputation, host syncs and
a decode path that expands the MLA latent per head are each named by the top finding."""

import argparse

import pytest
import torch

from ouro.lab import redundancy
from ouro.lab.findings import sort_findings, top_finding
from ouro.layers import dsa as dsa_layer
from ouro.layers import kda as kda_layer
from ouro.models.loader import load_model
from ouro.models.presets import make_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    make_model("tiny", d, progress=False)
    return load_model(d, dtype=torch.float32)


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


def test_recomputed_forget_gate_is_the_top_finding(model, monkeypatch):
    original = kda_layer.KDAttention.forget_gate

    def thrice(self, x):
        for _ in range(2):
            original(self, x)
        return original(self, x)
    monkeypatch.setattr(kda_layer.KDAttention, "forget_gate", thrice)
    top = top_finding(probe(model))
    assert top.severity == "warning" and "recomputes" in top.summary, top.summary
    assert top.where["file"] == "ouro/layers/kda.py" and top.where["function"] == "forget_gate"
    assert top.where["module"].startswith("layers.0.self_attn")


def test_host_sync_planted_in_a_layer_decode_path_is_the_top_finding(model, monkeypatch):
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


def test_expanded_mla_decode_is_the_top_finding(model, monkeypatch):
    monkeypatch.setattr(dsa_layer, "sparse_mla", _expanded_mla)
    findings = probe(model)
    top = top_finding(findings)
    assert top.severity == "warning" and "floor" in top.summary, top.summary
    assert top.where["module"] == "layers.3.self_attn" and top.where["file"] == "ouro/layers/dsa.py"


def test_cli_run_depends_only_on_args(tmp_path):
    make_model("tiny", tmp_path, progress=False)
    p = argparse.ArgumentParser()
    redundancy.add_arguments(p)
    findings = redundancy.run(p.parse_args(["--model", str(tmp_path), "--prompt-len", "8", "--context", "20"]))
    assert findings and all(f.probe == "redundancy" for f in findings)


def test_decode_work_growing_with_context_is_the_top_finding(model, monkeypatch):
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
