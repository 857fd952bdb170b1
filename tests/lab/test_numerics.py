"""The numerics probe: clean ouro gives no warning, planted bugs are found where they are."""

import json

import pytest
import torch

import ouro.engine.checkpointer as checkpointer
import ouro.layers.dsa as dsa_layer
import ouro.layers.kda as kda_layer
import ouro.layers.context as context_module
import ouro.layers.moe as moe_layer
from ouro.lab.numerics.probe import probe_numerics
from ouro.lab.numerics.run_configs import parse_config, pieces
from ouro.ops.conv1d import causal_conv1d
from ouro.ops.dsa import index_select
from ouro.ops.kda import kda_chunk
from ouro.ops.moe import route

N = 64   # 4 KDA chunks, 16 index pools (sparse past 16 tokens), 4 pages of 16


def worst(findings):
    return max(findings, key=lambda f: f.rank)


def top(findings):
    f = worst(findings)
    assert f.severity in ("warning", "error"), [x.summary for x in findings]
    return f


def test_config_parsing_names_the_bad_key():
    c = parse_config("dtype=float64,chunk=17,mode=decode,decode=4,prefix=hit,batch=3,kda_chunk=8")
    assert (c.dtype, c.chunk, c.mode, c.decode, c.prefix, c.batch, c.kda_chunk) == ("float64", 17, "decode", 4, "hit", 3, 8)
    assert pieces(parse_config("chunk=17"), 40) == [17, 17, 6]
    c = parse_config("cp=2,chunk=24,split=on")            # chunk: tokens per CP forward under cp
    assert (c.cp, c.chunk, c.split) == (2, 24, "on")
    assert pieces(parse_config("mode=decode,decode=3"), 10) == [7, 1, 1, 1]
    for bad, word in [("dtyp=float32", "dtyp"), ("dtype=float16", "dtype"), ("chunk=0", "chunk"),
                      ("impl=transformers,prefix=hit", "prefix"), ("mode", "mode"),
                      ("precision=tf32", "precision"), ("cp=2,precision=tf16", "precision"),
                      ("cp=2,mode=decode", "mode"), ("cp=2,impl=transformers", "impl"), ("cp=2,prefix=hit", "prefix"),
                      ("split=on", "split"), ("cp=2,split=yes", "split")]:
        with pytest.raises(ValueError, match=word):
            parse_config(bad)


def test_clean_ouro_through_the_cli(tmp_path):
    from ouro.cli import main
    out = tmp_path / "f.json"
    assert main(["probe", "numerics", "--model", "tiny", "--prompt-len", str(N), "--json", str(out),
                 "--fail-on", "warning"]) == 0
    findings = json.loads(out.read_text())["findings"]
    assert [f["severity"] for f in findings] == ["info"], findings
    assert findings[0]["measured"] < 1e-5   # logits fp64 vs fp32


def test_clean_ouro_prefix_hit_chunked_decode_batched():
    for a, b in [("prefix=cold", "prefix=hit,chunk=17"), ("dtype=float64", "mode=decode,decode=5,batch=3")]:
        f = probe_numerics("tiny", a, b, N)
        assert worst(f).severity == "info", [x.summary for x in f]


def test_router_ignoring_correction_bias_found_against_transformers(monkeypatch, eager_reference):
    monkeypatch.setattr(moe_layer, "route", lambda logits, bias, *a: route(logits, torch.zeros_like(bias), *a))
    f = top(probe_numerics("tiny-py", "impl=transformers", "impl=ouro", N))
    assert f.where["module"] == "layers.1.mlp.gate" and f.where["layer"] == 1   # the first MoE layer
    assert f.where["op"] == "route" and f.severity == "error"


def test_prefix_hit_restoring_zero_state_found_after_the_hit(monkeypatch):
    def restore(self, i, slot):
        self.cache.conv[:, slot] = 0.0
        self.cache.recurrent[:, slot] = 0.0
    monkeypatch.setattr(checkpointer.CheckpointStore, "restore", restore)
    f = top(probe_numerics("tiny", "prefix=cold", "prefix=hit", N))
    assert f.where["layer"] == 0 and f.where["module"] == "layers.0.self_attn"   # the first KDA layer
    assert f.where["positions"][0] == 32            # the hit covers pages 0-1
    assert "prefix-cache hit" in f.evidence["boundary"]


def test_chunked_prefill_dropping_conv_state_found_at_chunk_seams(monkeypatch):
    monkeypatch.setattr(kda_layer, "causal_conv1d",
                        lambda x, w, state, lengths: causal_conv1d(x, w, torch.zeros_like(state), lengths))
    f = top(probe_numerics("tiny", "", "chunk=17", N))
    assert f.where["op"] == "causal_conv1d" and f.where["layer"] == 0
    assert f.where["positions"][0] == 17 and f.where["file"] == "tests/lab/test_numerics.py"


def _tf32(x):
    if x.dtype != torch.float32:
        return x
    return ((x.view(torch.int32) + 0x1000) & ~0x1FFF).view(torch.float32)


def test_tf32_rounded_kda_state_accumulation_found_in_the_kernel(monkeypatch):
    def rounded(q, k, v, g, beta, initial_state=None, chunk_size=16):   # state between chunks in TF32
        outs, S = [], initial_state
        for s in range(0, q.shape[1], chunk_size):
            o, S = kda_chunk(*(t[:, s:s + chunk_size] for t in (q, k, v, g, beta)), S, chunk_size)
            S = _tf32(S)
            outs.append(o)
        return torch.cat(outs, 1), S
    monkeypatch.setattr(context_module, "kda_chunk", rounded)
    f = top(probe_numerics("tiny", "dtype=float64", "dtype=float32", N))
    assert (f.where["module"], f.where["op"], f.where["layer"]) == ("layers.0.self_attn", "kda_chunk", 0)
    assert f.where["positions"][0] == 16             # the first chunk carries no state
    assert f.evidence["growth"]["corr_with_position"] > 0.2


def test_indexer_tail_off_by_one_found_against_transformers(monkeypatch):
    def short_tail(q, w, pooled, positions, *a):    # the tail pool stops one token early
        out = index_select(q, w, pooled, positions, *a)
        return out.masked_fill(out == positions[:, None], -1)
    monkeypatch.setattr(dsa_layer, "index_select", short_tail)
    # fused=off: the eager selection (on this CPU every row otherwise takes the native op, whose own
    # planted fault is `index_select_op_*` in ouro/lab/faults)
    f = top(probe_numerics("tiny", "impl=transformers", "impl=ouro,fused=off", N))
    assert f.where["module"] == "layers.3.self_attn.indexer" and f.where["op"] == "index_select"


@pytest.mark.processes
@pytest.mark.slow
def test_context_parallel_runs_compare_position_by_position():
    """cp=N runs N real ranks (gloo), each tapping its slice at global positions: fp32 and tf32x3
    agree with one rank; tf32 is found in the first KDA layer's kernel, as an error."""
    f = probe_numerics("tiny", "cp=1", "cp=2", 50)         # cut at 25: mid-chunk, mid-pool
    assert worst(f).severity == "info" and worst(f).evidence["positions"] == 50, [x.summary for x in f]
    f = probe_numerics("tiny", "dtype=float64", "cp=3,precision=tf32x3", N)
    assert worst(f).severity == "info", [x.summary for x in f]
    f = top(probe_numerics("tiny", "dtype=float64", "cp=2,precision=tf32", N))   # ~9x its tolerance: warning or error
    assert f.where["layer"] == 0 and f.where["op"] == "kda_chunk"
    assert f.where["positions"][0] == 16             # products start with the second chunk


def test_cp_boundary_note_names_what_crosses_the_cut():
    from ouro.lab.numerics.probe import _boundary_note
    ctx = dict(n=96, a=parse_config("cp=1"), b=parse_config("cp=3"))
    assert "rank 1 of 3" in _boundary_note(ctx, 32, "causal_conv1d") and "conv_halo" in _boundary_note(ctx, 32, "causal_conv1d")
    assert "state chain" in _boundary_note(ctx, 64, "kda_chunk")
    assert _boundary_note(ctx, 33, "kda_chunk") is None and _boundary_note(ctx, 0, "kda_chunk") is None


@pytest.fixture
def eager_reference():
    """Faults planted in the eager code (the fused native ops' reference) are looked for on the eager
    path; faults inside the native kernels: tests/lab/test_fused.py."""
    from ouro.native.kernels import eager_only
    with eager_only():
        yield
