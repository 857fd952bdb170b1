"""glm5_next configs as the GLM-5.3-Flash release spells them, and ouro's checkpoints as llama.cpp's
glm5next converter reads them (issue 38, part 3).

The release's `text_config` names DSA layers `"deepseek_sparse_attention"` (transformers reads that
as `"indexed_attention"`), keeps the KDA sizes and gate only in `linear_attn_config` (with 0-based
`kda_layers` / `full_attn_layers`), says `mhc: true` beside the flat `hc_*` fields, and carries
`first_k_dense_replace`, `mla_use_nope`, `index_kpool_compress`, `indexer_rope_interleave`,
`scoring_func`. ouro must read such a config as transformers does (down to the logits), and what
ouro writes must pass the config reads of the converter (`conversion/glm5next.py`), which takes the
raw config.json with `text_config` lifted to the top."""

import dataclasses
import json

import pytest
import torch
from transformers import Glm5NextConfig

from ouro.lab.reference.checkpoint import SHAPES, VISION
from ouro.config import CheckpointError, ModelConfig
from ouro.models.presets import PRESETS, make_model

DSA_GLM = "deepseek_sparse_attention"


def glm_spelling(text: dict, gate_lower_bound=-5.0) -> dict:
    """`text` (a transformers-spelled text_config) as the GLM release spells it."""
    t = {k: v for k, v in text.items() if not k.startswith("linear_")}
    layer_types = [DSA_GLM if x in ("indexed_attention", DSA_GLM) else x for x in text["layer_types"]]
    k = list(text["mlp_layer_types"]).count("dense")
    t.update(layer_types=layer_types, first_k_dense_replace=k, mla_use_nope=True, mhc=True,
             index_kpool_compress=True, indexer_rope_interleave=True, index_share_for_mtp_iteration=True,
             scoring_func="sigmoid", topk_method="noaux_tc", moe_router_dtype="float32", moe_layer_freq=1,
             linear_attn_config={"num_heads": text["linear_num_heads"], "head_dim": text["linear_head_dim"],
                                 "short_conv_kernel_size": text.get("linear_conv_kernel_dim", 4),
                                 "gate_lower_bound": gate_lower_bound,
                                 "kda_layers": [i for i, x in enumerate(layer_types) if x == "linear_attention"],
                                 "full_attn_layers": [i for i, x in enumerate(layer_types) if x == DSA_GLM]})
    return t


def _same_as_transformers(ours: ModelConfig, hf) -> None:
    compared = 0
    for f in dataclasses.fields(ModelConfig):
        if hasattr(hf, f.name) and f.name not in ("eos_token_id", "pad_token_id"):
            theirs = getattr(hf, f.name)
            assert getattr(ours, f.name) == (tuple(theirs) if isinstance(theirs, list) else theirs), f.name
            compared += 1
    assert compared > 30


@pytest.mark.parametrize("shape", ["tiny", "shared"])
@pytest.mark.parametrize("bound", [-5.0, -2.5])
def test_the_glm_release_spelling_reads_as_transformers_reads_it(shape, bound):
    text = glm_spelling(SHAPES[shape], gate_lower_bound=bound)
    hf = Glm5NextConfig(text_config=text, vision_config=VISION).text_config
    ours = ModelConfig.from_dict({"model_type": "glm5_next", "text_config": text})
    _same_as_transformers(ours, hf)
    assert ours.dsa_layers == text["linear_attn_config"]["full_attn_layers"] and ours.dsa_layers
    assert ours.kda_layers == text["linear_attn_config"]["kda_layers"]
    assert ours.linear_lower_bound == bound


def test_a_checkpoint_in_the_glm_spelling_gives_transformers_logits(tmp_path):
    """The tiny reference checkpoint with its config.json rewritten in the release's spelling: ouro
    builds the DSA layers from `"deepseek_sparse_attention"` and its logits are transformers'."""
    from ouro.lab.reference.compare import compare, reference_run
    from ouro.lab.reference.checkpoint import make_hf_checkpoint
    from transformers import Glm5NextForConditionalGeneration

    from ouro.models.loader import load_model

    make_hf_checkpoint("tiny", tmp_path)
    path = tmp_path / "config.json"
    d = json.loads(path.read_text())
    d["text_config"] = glm_spelling(d["text_config"])
    path.write_text(json.dumps(d))
    hf = Glm5NextForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32).eval()
    model = load_model(tmp_path)
    assert list(hf.config.text_config.layer_types) == list(model.config.layer_types)
    assert model.config.dsa_layers == [3]
    ids = torch.randint(0, model.config.vocab_size, (80,), generator=torch.Generator().manual_seed(4))
    result = compare(model, reference_run(hf, ids, 2))
    assert result.passes(), str(result)


@pytest.mark.parametrize("spelling,reads_as", [("deepseek_sparse_attention", "indexed_attention"),
                                               ("full_attention", "indexed_attention"),
                                               ("mamba", "linear_attention")])
def test_layer_type_spellings_transformers_reads(spelling, reads_as):
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    types = ["linear_attention", "linear_attention", "linear_attention", "indexed_attention"]
    i = 3 if reads_as == "indexed_attention" else 0
    types[i] = spelling
    assert Glm5NextTextConfig(num_hidden_layers=4, layer_types=types).layer_types[i] == reads_as
    assert ModelConfig.from_dict({"num_hidden_layers": 4, "layer_types": types}).layer_types[i] == reads_as


@pytest.mark.parametrize("key,value", [("layer_types", ["linear_attention"] * 3 + ["softmax_attention"]),
                                       ("mlp_layer_types", ["dense", "moe", "sparse", "sparse"]),
                                       ("indexer_types", ["full", "full", "full", "partial"])])
def test_a_layer_kind_ouro_cannot_build_is_refused_naming_the_key(key, value):
    with pytest.raises(CheckpointError, match=f"config: {key} has"):
        ModelConfig.from_dict({"num_hidden_layers": 4, key: value})


K, D = "linear_attention", "indexed_attention"


@pytest.mark.parametrize("layers,indexers,bad", [
    ([D, D, D, D], ["full", "shared", "shared", "full"], 2),        # shared after shared
    ([D, K, D, K], ["full", "full", "shared", "full"], 2),          # shared after a KDA layer
    ([K, D, K, D], ["full", "full", "full", "shared"], 3),
    ([D, D, K, D], ["full", "shared", "full", "full"], None),       # each shared layer right after a full one
    ([K, K, K, K], ["full", "shared", "shared", "full"], None)])    # (a KDA layer's indexer type means nothing)
def test_a_shared_indexer_must_follow_a_full_dsa_layer(layers, indexers, bad):
    """transformers hands a full DSA layer's selection to the next layer only (and refuses anything
    else at its first forward): ouro refuses those layouts when it reads the config, naming the layer."""
    text = {"num_hidden_layers": 4, "layer_types": layers, "indexer_types": indexers}
    if bad is None:
        assert ModelConfig.from_dict(text).indexer_types == tuple(indexers)
    else:
        with pytest.raises(CheckpointError, match=f"layer {bad}'s indexer is 'shared'"):
            ModelConfig.from_dict(text)


@pytest.mark.parametrize("key,value", [("index_kpool_compress", False), ("scoring_func", "softmax")])
def test_a_glm_key_naming_another_model_is_refused(key, value):
    text = {**PRESETS["tiny"].to_hf_dict()["text_config"], key: value}
    with pytest.raises(CheckpointError, match=f"config: {key} = "):
        ModelConfig.from_dict(text)


# ---- what llama.cpp's glm5next converter reads from the (raw) config.json ----

def converter_reads(hp: dict) -> dict:
    """The config checks and reads of llama.cpp's `conversion/glm5next.py` (Glm5NextModel: `__init__`
    and `set_gguf_parameters`), restated: raises as the converter would, else returns the GGUF
    hyperparameters it writes from the config."""
    hp = {**hp, **hp.get("text_config", {})}          # TextModel lifts text_config to the top
    lac = hp["linear_attn_config"]
    dsa_from_types = {i for i, t in enumerate(hp["layer_types"]) if t == DSA_GLM}
    if dsa_from_types != set(lac["full_attn_layers"]):
        raise ValueError(f"layer_types picks DSA layers {sorted(dsa_from_types)} but full_attn_layers "
                         f"says {sorted(lac['full_attn_layers'])}")
    k = hp["first_k_dense_replace"]
    if hp["mlp_layer_types"] != ["dense"] * k + ["sparse"] * (hp["num_hidden_layers"] - k):
        raise ValueError("mlp_layer_types does not match first_k_dense_replace")
    if hp["num_attention_heads"] != hp.get("num_key_value_heads"):
        raise ValueError("num_key_value_heads")
    if hp["qk_rope_head_dim"] != 0 or not hp.get("mla_use_nope"):
        raise ValueError("mla_use_nope")
    if lac["num_heads"] != hp["num_attention_heads"]:
        raise ValueError("KDA and MLA head counts differ (a limit of llama.cpp's glm5next)")
    for key in ("mhc", "index_kpool_compress", "index_kpool_always_select_tail", "indexer_rope_interleave"):
        if not hp.get(key):
            raise ValueError(f"{key} missing or false")
    if hp["index_topk"] % hp["index_kpool"] or set(hp["indexer_types"]) != {"full"}:
        raise ValueError("indexer")
    n = hp["num_hidden_layers"]
    return {"head_count_kv": [1 if i in dsa_from_types else 0 for i in range(n)],
            "ssm_conv_kernel": lac["short_conv_kernel_size"], "kda_head_dim": lac["head_dim"],
            "kda_head_count": lac["num_heads"], "kda_gate_lower_bound": lac["gate_lower_bound"],
            "leading_dense_block_count": k, "hc": (hp["hc_mult"], hp["hc_sinkhorn_iters"], hp["hc_eps"]),
            "key_length_mla": hp["qk_nope_head_dim"] + hp["qk_rope_head_dim"], "indexer_kpool": hp["index_kpool"]}


def test_an_ouro_checkpoint_passes_the_llama_cpp_converter_reads(tmp_path):
    make_model("tiny", tmp_path / "m", progress=False)
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    got = converter_reads(raw)
    cfg = PRESETS["tiny"]
    assert got == {"head_count_kv": [int(i in cfg.dsa_layers) for i in range(cfg.num_hidden_layers)],
                   "ssm_conv_kernel": cfg.linear_conv_kernel_dim, "kda_head_dim": cfg.linear_head_dim,
                   "kda_head_count": cfg.linear_num_heads, "kda_gate_lower_bound": cfg.linear_lower_bound,
                   "leading_dense_block_count": cfg.mlp_layer_types.count("dense"),
                   "hc": (cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps),
                   "key_length_mla": cfg.qk_head_dim, "indexer_kpool": cfg.index_kpool}
    # and the same file is what transformers and ouro read
    hf = Glm5NextConfig.from_pretrained(tmp_path / "m").text_config
    _same_as_transformers(ModelConfig.from_hf(tmp_path / "m"), hf)
    assert ModelConfig.from_hf(tmp_path / "m") == cfg


def test_the_converter_restatement_refuses_what_the_converter_refuses():
    """The restated reads can fail: the transformers spelling of a DSA layer, a missing key."""
    text = PRESETS["tiny"].to_hf_dict()["text_config"]
    converter_reads(text)
    spelled = dict(text, layer_types=["indexed_attention" if t == DSA_GLM else t for t in text["layer_types"]])
    with pytest.raises(ValueError, match="full_attn_layers"):
        converter_reads(spelled)
    for key in ("mhc", "index_kpool_compress", "indexer_rope_interleave", "first_k_dense_replace"):
        with pytest.raises((ValueError, KeyError)):
            converter_reads({k: v for k, v in text.items() if k != key})
