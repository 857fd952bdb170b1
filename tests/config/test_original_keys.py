"""A checkpoint ouro writes carries the original GLM config keys beside the transformers ones
(`linear_attn_config`, `first_k_dense_replace`, `mla_use_nope`, `mhc`: what llama.cpp's converter
and vLLM read), with the same meaning, and ouro reads `linear_attn_config`'s gate as transformers
does, down to the logits (issue 38, part 3)."""

import dataclasses
import json

import pytest
import torch
from transformers import Glm5NextConfig
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

from ouro.config import CheckpointError, ModelConfig
from ouro.models.presets import PRESETS

FIELDS = ("linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim", "linear_lower_bound", "hc_mult",
          "hc_eps", "hc_sinkhorn_iters", "num_hidden_layers", "hidden_size", "qk_nope_head_dim", "v_head_dim",
          "qk_rope_head_dim")
LINEAR = ("linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim", "linear_lower_bound")


def _hf(text: dict) -> Glm5NextTextConfig:
    return Glm5NextTextConfig(**{k: v for k, v in text.items() if k != "model_type"})


def _original_keys_mean(text: dict, cfg: ModelConfig, hf) -> None:
    """The original keys in `text` say what ouro's `cfg` and transformers' `hf` say."""
    lac = text["linear_attn_config"]
    assert (lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]) == (
        cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim)
    # transformers' own reading of the gate keys gives ouro's bound
    assert lac["gate_lower_bound"] == cfg.linear_lower_bound == hf.linear_lower_bound
    assert lac["safe_gate"] is (cfg.linear_lower_bound is not None)
    assert lac["kda_layers"] == [i for i, t in enumerate(hf.layer_types) if t == "linear_attention"] == cfg.kda_layers
    assert lac["full_attn_layers"] == [i for i, t in enumerate(hf.layer_types) if t != "linear_attention"] \
        == cfg.dsa_layers
    k = text["first_k_dense_replace"]
    assert list(hf.mlp_layer_types) == ["dense"] * k + ["sparse"] * (cfg.num_hidden_layers - k)
    assert text["mla_use_nope"] is True and hf.qk_rope_head_dim == 0 and cfg.qk_head_dim == hf.qk_head_dim
    assert text["mhc"] is True and (text["hc_mult"], text["hc_eps"], text["hc_sinkhorn_iters"]) == (
        cfg.hc_mult, cfg.hc_eps, cfg.hc_sinkhorn_iters)


# the presets, and one whose sizes all differ from transformers' defaults and the presets'
CONFIGS = {"tiny": PRESETS["tiny"], "small": PRESETS["small"],
           "odd": dataclasses.replace(PRESETS["tiny"], linear_conv_kernel_dim=3, linear_num_heads=3, linear_head_dim=8,
                                      hc_mult=2, hc_eps=1e-5, hc_sinkhorn_iters=7,
                                      mlp_layer_types=("dense", "dense", "sparse", "sparse"),
                                      layer_types=("linear_attention", "indexed_attention", "linear_attention",
                                                   "indexed_attention"))}


@pytest.mark.parametrize("lower_bound", [-5.0, -3.5, None])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_written_config_round_trips_through_transformers_with_the_original_keys(name, lower_bound):
    cfg = dataclasses.replace(CONFIGS[name], linear_lower_bound=lower_bound)
    text = cfg.to_hf_dict()["text_config"]
    hf = _hf(text)
    for f in FIELDS:
        assert getattr(hf, f) == getattr(cfg, f, 0), f
    assert list(hf.mlp_layer_types) == list(cfg.mlp_layer_types)
    assert list(hf.layer_types) == list(cfg.layer_types)
    _original_keys_mean(text, cfg, hf)
    # and ouro reads back what it wrote
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_hf_dict()))) == cfg


def test_a_made_checkpoint_carries_them_and_transformers_config_class_reads_it(tiny_checkpoint):
    """The path `ouro make-model` takes: config.json loaded by transformers' own config class."""
    d = json.loads((tiny_checkpoint / "config.json").read_text())
    text = d["text_config"]
    assert {"linear_attn_config", "first_k_dense_replace", "mla_use_nope", "mhc"} <= set(text)
    hf = Glm5NextConfig.from_pretrained(tiny_checkpoint).text_config
    cfg = ModelConfig.from_hf(tiny_checkpoint)
    assert cfg == PRESETS["tiny"]
    for f in FIELDS:
        assert getattr(hf, f) == getattr(cfg, f, 0), f
    _original_keys_mean(text, cfg, hf)


def _only_original(text: dict, **lac_extra) -> dict:
    """`text` as the original GLM checkpoint spells it: KDA sizes and gate only in linear_attn_config."""
    text = dict(text)
    lac = {"num_heads": text.pop("linear_num_heads"), "head_dim": text.pop("linear_head_dim"),
           "short_conv_kernel_size": text.pop("linear_conv_kernel_dim")}
    text.pop("linear_lower_bound")
    text["linear_attn_config"] = dict(lac, **lac_extra)
    return text


ORIGINAL_GATES = [({"gate_lower_bound": -2.0}, -2.0), ({"gate_lower_bound": -2.0, "safe_gate": False}, -2.0),
                  ({"gate_lower_bound": None, "safe_gate": True}, -5.0), ({"safe_gate": False, "gate_lower_bound": None}, None),
                  ({}, -5.0), ({"safe_gate": True}, -5.0), ({"safe_gate": False}, -5.0)]


@pytest.mark.parametrize("lac_gate,expected", ORIGINAL_GATES)
@pytest.mark.parametrize("flat", [None, -7.0, "absent"])
def test_linear_attn_config_is_read_as_transformers_reads_it(lac_gate, expected, flat):
    text = PRESETS["tiny"].to_hf_dict()["text_config"]
    for key in LINEAR:
        text.pop(key)
    if flat != "absent":
        text["linear_lower_bound"] = flat
    text["linear_attn_config"] = {"num_heads": 2, "head_dim": 8, "short_conv_kernel_size": 3, **lac_gate}
    hf = _hf(text)
    ours = ModelConfig.from_dict(text)
    for f in LINEAR:
        assert getattr(ours, f) == getattr(hf, f), f
    assert (ours.linear_num_heads, ours.linear_head_dim, ours.linear_conv_kernel_dim) == (2, 8, 3)
    if "gate_lower_bound" in lac_gate or flat == "absent":
        assert ours.linear_lower_bound == expected


@pytest.mark.parametrize("gate,expected", [({"gate_lower_bound": -2.5}, -2.5),
                                           ({"gate_lower_bound": None, "safe_gate": False}, None),
                                           ({"safe_gate": True}, -5.0)])
def test_a_config_json_with_only_the_original_keys_reads_as_transformers_reads_it(tmp_path, gate, expected):
    d = PRESETS["tiny"].to_hf_dict()
    d["text_config"] = _only_original(d["text_config"], **gate)
    for key in ("kda_layers", "full_attn_layers"):
        assert key not in d["text_config"]["linear_attn_config"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    hf = Glm5NextConfig.from_pretrained(tmp_path).text_config
    ours = ModelConfig.from_hf(tmp_path)
    for f in FIELDS:
        assert getattr(ours, f, 0) == getattr(hf, f), f
    assert ours.linear_lower_bound == hf.linear_lower_bound == expected
    assert ours == dataclasses.replace(PRESETS["tiny"], linear_lower_bound=hf.linear_lower_bound)


def test_the_form_an_earlier_ouro_wrote_is_still_read():
    text = PRESETS["tiny"].to_hf_dict()["text_config"]
    text["mhc"] = {"hc_mult": text["hc_mult"], "hc_eps": text["hc_eps"], "hc_sinkhorn_iters": text["hc_sinkhorn_iters"]}
    assert ModelConfig.from_dict(text) == PRESETS["tiny"]


def _lac(**change):
    return {"linear_attn_config": dict(PRESETS["tiny"].to_hf_dict()["text_config"]["linear_attn_config"], **change)}


@pytest.mark.parametrize("change,says", [
    ({"first_k_dense_replace": 2}, "first_k_dense_replace"),
    ({"mla_use_nope": False}, "mla_use_nope"),
    ({"mhc": False}, "mhc is False"),
    ({"mhc": {"hc_mult": 2}}, "mhc.hc_mult"),
    (_lac(kda_layers=[0, 1, 3]), "linear_attn_config.kda_layers"),
    (_lac(full_attn_layers=[2]), "linear_attn_config.full_attn_layers"),
    (_lac(gate_lower_bound=1.0), r"gate_lower_bound\) = 1.0"),
    (_lac(gate_lower_bound="-5"), "gate_lower_bound"),
])
def test_original_keys_that_disagree_or_cannot_run_are_refused_naming_the_key(change, says):
    text = {**PRESETS["tiny"].to_hf_dict()["text_config"], **change}
    with pytest.raises(CheckpointError, match=says):
        ModelConfig.from_dict(text)


# ---- the gate the original keys select is the gate ouro runs: logits against transformers ----

@pytest.mark.parametrize("gate,other", [({"gate_lower_bound": -2.0}, -5.0),
                                        ({"gate_lower_bound": None, "safe_gate": False}, -5.0)])
def test_the_gate_read_from_linear_attn_config_gives_transformers_logits(tmp_path, gate, other):
    from ouro.lab.reference.compare import compare, reference_run
    from ouro.lab.reference.checkpoint import make_hf_checkpoint
    from transformers import Glm5NextForConditionalGeneration

    from ouro.models.glm5_next import Glm5NextModel
    from ouro.models.loader import load_model, load_weights

    # transformers builds (and initialises) the model from the original key, then the checkpoint is
    # rewritten in the original form: the gate only in linear_attn_config
    make_hf_checkpoint("tiny", tmp_path, linear_attn_config=dict(gate))
    path = tmp_path / "config.json"
    d = json.loads(path.read_text())
    text = d["text_config"]
    text["linear_attn_config"] = {"num_heads": text["linear_num_heads"], "head_dim": text["linear_head_dim"],
                                  "short_conv_kernel_size": text["linear_conv_kernel_dim"], **gate}
    for key in LINEAR:
        text.pop(key)
    path.write_text(json.dumps(d))
    hf = Glm5NextForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32).eval()
    want = gate.get("gate_lower_bound")
    assert hf.config.text_config.linear_lower_bound == want
    model = load_model(tmp_path)
    assert model.config.linear_lower_bound == want
    ids = torch.randint(0, model.config.vocab_size, (96,), generator=torch.Generator().manual_seed(3))
    ref = reference_run(hf, ids, 3)
    result = compare(model, ref)
    assert result.passes(), f"{gate}: {result}"
    # the gate key matters: the same weights under the default bound do not give these logits
    wrong = Glm5NextModel(dataclasses.replace(model.config, linear_lower_bound=other))
    load_weights(wrong, tmp_path)
    assert not compare(wrong.eval(), ref).passes(), f"{gate}: the gate made no difference"
