"""A checkpoint ouro writes carries the original GLM config keys beside the transformers ones
(`linear_attn_config`, `first_k_dense_replace`, `mla_use_nope`, `mhc`), with the same meaning, and
ouro reads `linear_attn_config`'s gate as transformers does (issue 38, part 3)."""

import dataclasses
import json

import pytest
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

from ouro.config import CheckpointError, ModelConfig
from ouro.models.presets import PRESETS, make_model

FIELDS = ("linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim", "linear_lower_bound", "hc_mult",
          "hc_eps", "hc_sinkhorn_iters", "num_hidden_layers", "hidden_size", "qk_nope_head_dim", "v_head_dim")


def _hf(text: dict) -> Glm5NextTextConfig:
    return Glm5NextTextConfig(**{k: v for k, v in text.items() if k != "model_type"})


@pytest.mark.parametrize("lower_bound", [-5.0, -3.5, None])
@pytest.mark.parametrize("name", ["tiny", "small"])
def test_written_config_round_trips_through_transformers_with_the_original_keys(tmp_path, name, lower_bound):
    cfg = dataclasses.replace(PRESETS[name], linear_lower_bound=lower_bound)
    text = cfg.to_hf_dict()["text_config"]
    hf = _hf(text)
    for f in FIELDS:
        assert getattr(hf, f) == getattr(cfg, f), f
    assert list(hf.mlp_layer_types) == list(cfg.mlp_layer_types)
    # the original keys, each with its meaning
    lac = text["linear_attn_config"]
    assert (lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]) == (
        cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim)
    assert lac["gate_lower_bound"] == lower_bound and lac["safe_gate"] is (lower_bound is not None)
    k = text["first_k_dense_replace"]
    assert list(cfg.mlp_layer_types) == ["dense"] * k + ["sparse"] * (cfg.num_hidden_layers - k)
    assert text["mla_use_nope"] is True and hf.qk_rope_head_dim == 0
    assert text["mhc"] == {"hc_mult": cfg.hc_mult, "hc_eps": cfg.hc_eps, "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters}
    # and ouro reads back what it wrote
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_hf_dict()))) == cfg


def test_a_made_checkpoint_carries_them(tmp_path):
    make_model("tiny", tmp_path / "m")
    text = json.loads((tmp_path / "m" / "config.json").read_text())["text_config"]
    assert {"linear_attn_config", "first_k_dense_replace", "mla_use_nope", "mhc"} <= set(text)
    assert ModelConfig.from_hf(tmp_path / "m") == PRESETS["tiny"]


ORIGINAL_GATES = [({"gate_lower_bound": -2.0}, -2.0), ({"gate_lower_bound": -2.0, "safe_gate": False}, -2.0),
                  ({"gate_lower_bound": None, "safe_gate": True}, -5.0), ({"safe_gate": False, "gate_lower_bound": None}, None),
                  ({}, -5.0), ({"safe_gate": True}, -5.0)]


@pytest.mark.parametrize("lac_gate,expected", ORIGINAL_GATES)
@pytest.mark.parametrize("flat", [None, -7.0, "absent"])
def test_linear_attn_config_is_read_as_transformers_reads_it(lac_gate, expected, flat):
    text = PRESETS["tiny"].to_hf_dict()["text_config"]
    for key in ("linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim", "linear_lower_bound"):
        text.pop(key)
    if flat != "absent":
        text["linear_lower_bound"] = flat
    text["linear_attn_config"] = {"num_heads": 2, "head_dim": 8, "short_conv_kernel_size": 3, **lac_gate}
    hf = _hf(text)
    ours = ModelConfig.from_dict(text)
    for f in ("linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim", "linear_lower_bound"):
        assert getattr(ours, f) == getattr(hf, f), f
    if "gate_lower_bound" in lac_gate or flat == "absent":
        assert ours.linear_lower_bound == expected


@pytest.mark.parametrize("change,says", [({"first_k_dense_replace": 2}, "first_k_dense_replace"),
                                         ({"mla_use_nope": False}, "mla_use_nope"),
                                         ({"mhc": {"hc_mult": 2}}, "mhc.hc_mult")])
def test_original_keys_that_disagree_are_refused_naming_the_key(change, says):
    text = {**PRESETS["tiny"].to_hf_dict()["text_config"], **change}
    with pytest.raises(CheckpointError, match=says):
        ModelConfig.from_dict(text)
