"""The lab under tensor parallelism: `ouro probe numerics --a tp=1 --b tp=2` joins the ranks'
taps into one rank's view and finds nothing on a correct split; the ranks' collective logs name
the first collective a rank did not join; tp/ep configuration keys are checked."""

from __future__ import annotations

import pytest

from ouro.lab.numerics import compare, probe_numerics
from ouro.lab.run_configs import parse_config, run_config
from ouro.lab.tp_run import first_mismatch
from ouro.models.resolve import resolve_model


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
    assert {"layers.0.self_attn.o_proj", "layers.0.self_attn.q_proj", "layers.3.self_attn.q_b_proj",
            "layers.1.mlp", "lm_head"} <= keys
    assert not any(r["diverges"] for r in rows), [r["key"] for r in rows if r["diverges"]]
    findings = probe_numerics("tiny", "tp=1", "tp=2", prompt_len=40)
    assert [f.severity for f in findings] == ["info"]


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
