"""The lab under tensor parallelism: `ouro probe numerics --a tp=1 --b tp=2` joins the ranks'
taps into each rank's view (column slices side by side, partial sums added, reduced outputs per
rank) and finds nothing on a correct split; a partial sum left out of the all-reduce is named at
its module, in its layer; the ranks' collective logs name the first collective a rank did not
join; tp/ep configuration keys are checked."""

from __future__ import annotations

import functools
import os

import pytest
import torch

from ouro.lab.numerics import tp_run
from ouro.lab.faults.scoring import score
from ouro.lab.faults import all_faults
from ouro.lab.numerics.probe import compare, probe_numerics
from ouro.lab.numerics.run_configs import parse_config, run_config
from ouro.lab.numerics.taps import Recording
from ouro.lab.numerics.tp_run import first_mismatch, joined, layout
from ouro.models.resolve import resolve_model
from tests.helpers.tp_fault_rank import faulted_rank

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# fault -> the module the first divergence must name (before: one layer late, or past the module)
LEFT_OUT = {"tp_shared_expert_not_reduced": "layers.1.mlp",            # was layers.2.self_attn.q_proj
            "tp_mla_o_proj_not_reduced": "layers.3.self_attn.o_proj"}        # was layers.3.mlp.shared_experts.gate_proj


@pytest.mark.processes
@pytest.mark.slow       # TP=2 against TP=1 token for token is tested by default (test_tp.py)
def test_tp2_agrees_with_tp1_module_by_module():
    d = resolve_model("tiny")
    prompt = list(range(3, 43))
    one = run_config(d, parse_config("tp=1"), prompt)
    two = run_config(d, parse_config("tp=2,ep=on"), prompt)
    assert two.tp_mismatch is None and two.tp_errors == {}
    rows = compare(one, two, "float32")
    keys = {r["key"] for r in rows}
    # every layer's all-reduced output and the gathered column projections are compared
    assert {"layers.0.self_attn.o_proj", "layers.0.self_attn.q_proj", "layers.3.self_attn.q_b_proj", "layers.3.self_attn.kv_b_proj",
            "layers.1.mlp", "lm_head"} <= keys
    # and what runs on one rank's heads or channels, or is a partial sum: joined, compared too (with
    # ep=on the routed experts run on the rows routed to this rank, not per token: not tapped)
    assert {"layers.0.self_attn.causal_conv1d", "layers.0.self_attn.o_norm", "layers.0.self_attn.attention_core",
            "layers.0.mlp.clamped_swiglu", "layers.1.mlp.shared_experts", "layers.1.mlp.shared_experts.down_proj",
            "layers.3.self_attn.attention_core"} <= keys
    assert not any(r["diverges"] for r in rows), [r["key"] for r in rows if r["diverges"]]
    findings = probe_numerics("tiny", "tp=1", "tp=2", prompt_len=40)
    assert [f.severity for f in findings] == ["info"]


def _rec(rows: dict) -> Recording:
    r = Recording(n_experts=2, width=4)
    for k, t in rows.items():
        r.add(k, t, torch.arange(t.shape[0]))
    return r


def test_ranks_are_joined_into_what_each_should_hold():
    assert [layout(k) for k in ("layers.0.self_attn.q_proj", "layers.0.self_attn.o_norm", "layers.0.mlp.clamped_swiglu",
                                "layers.0.self_attn.causal_conv1d", "layers.1.mlp.experts",
                                "layers.1.mlp.experts.experts_grouped", "layers.1.mlp.shared_experts",
                                "layers.1.mlp.shared_experts.down_proj", "layers.1.mlp.shared_experts.gate_proj",
                                "layers.0.self_attn.o_proj", "layers.1.mlp", "layers.1.mlp.down_proj", "hc_head")] == \
        ["concat", "concat", "concat", "thirds", "sum", "sum", "sum", "sum", "concat"] + ["replicated"] * 4
    a, b = torch.arange(12.).view(2, 6), torch.arange(12., 24.).view(2, 6)
    same, other = torch.ones(2, 3), torch.zeros(2, 3)
    parts = [_rec({"l.q_proj": a, "l.causal_conv1d": a, "l.mlp.shared_experts": a, "l.o_proj": same, "l.mlp": same}),
             _rec({"l.q_proj": b, "l.causal_conv1d": b, "l.mlp.shared_experts": b, "l.o_proj": same, "l.mlp": other})]
    view = joined(parts)
    assert len(view.rank_views) == 2 and view.tp_disagree == ["l.mlp"]
    for v in view.rank_views:
        assert torch.equal(v.stacked("l.q_proj")[1], torch.cat([a, b], 1))
        assert torch.equal(v.stacked("l.causal_conv1d")[1],
                           torch.cat([a[:, :2], b[:, :2], a[:, 2:4], b[:, 2:4], a[:, 4:], b[:, 4:]], 1))
        assert torch.equal(v.stacked("l.mlp.shared_experts")[1], a + b)
        assert torch.equal(v.stacked("l.o_proj")[1], same)
    assert torch.equal(view.rank_views[0].stacked("l.mlp")[1], same)      # each rank's own reduced output
    assert torch.equal(view.rank_views[1].stacked("l.mlp")[1], other)


@pytest.mark.processes
@pytest.mark.parametrize("name", sorted(LEFT_OUT))
def test_a_partial_sum_left_out_of_the_all_reduce_is_named_at_its_module(name, monkeypatch):
    fault = next(f for f in all_faults() if f.name == name)
    assert fault.probes == [["numerics", "--model", "tiny", "--a", "tp=1", "--b", "tp=2"]]
    # the ranks are spawned processes: the fault is applied in each (tests/helpers/tp_fault_rank.py)
    monkeypatch.setattr(tp_run, "_tp_rank", functools.partial(faulted_rank, name, REPO))
    found = probe_numerics("tiny", "tp=1", "tp=2")
    s = score(found, fault.localised, {3})
    assert s["detected"] and s["localised"], s["top"]
    assert f"first divergence at {LEFT_OUT[name]} " in s["top"]["summary"], s["top"]["summary"]
    assert "all-reduce" in s["top"]["summary"]
    assert found[0].evidence["tensor_parallel"]["reduced_outputs_the_ranks_disagree_on"][0] == LEFT_OUT[name]


def test_first_collective_a_rank_did_not_join_is_named():
    ar = lambda m: ("all_reduce", (4, 8), m)
    order = {"embed_tokens": 0, "layers.0.self_attn.o_proj": 1, "layers.0.mlp.down_proj": 2, "layers.1.mlp": 3}
    same = [ar("embed_tokens"), ar("layers.0.self_attn.o_proj"), ar("layers.1.mlp")]
    assert first_mismatch([same, list(same)], order) is None
    skipped = [ar("embed_tokens"), ar("layers.1.mlp")]                    # rank 1 skipped o_proj's
    got = first_mismatch([same, skipped], order)
    assert got["module"] == "layers.0.self_attn.o_proj" and got["ranks_missing"] == [1] and got["index"] == 1
    got = first_mismatch([skipped, same], order)                          # whichever rank it is
    assert got["module"] == "layers.0.self_attn.o_proj" and got["ranks_missing"] == [0]
    short = same[:2]                                                      # a rank that stopped early
    assert first_mismatch([same, short], order)["module"] == "layers.1.mlp"


@pytest.mark.parametrize("text, message", [("tp=2,prefix=hit", "does not combine with tp=2"),
                                           ("tp=2,impl=transformers", "does not combine with tp=2"),
                                           ("ep=on", "needs tp=N"), ("tp=0", "positive integer"),
                                           ("tp=2,ep=maybe", "must be one of off, on")])
def test_tp_configuration_keys_are_checked(text, message):
    with pytest.raises(ValueError, match=message):
        parse_config(text)
