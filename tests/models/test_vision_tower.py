"""ouro's vision tower against transformers' `Glm5NextVisionModel` (float32, every weight random),
its checkpoint I/O under `model.visual.*`, the `tiny-vl` preset, and mutations that must fail."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from tests.helpers.numerics import rel_rms
from ouro.config import CheckpointError, ModelConfig
from ouro.config.model import MEDIA_TOKEN_FIELDS, VisionConfig
from ouro.models import vision as ouro_vision
from ouro.models.glm5_next import Glm5NextModel
from ouro.models.loader import load_model, load_vision, save_weights
from ouro.models.presets import PRESETS, VISION_PRESETS, init_weights, make_model
from ouro.models.tokenizer_factory import MEDIA_TOKENS
from ouro.models.vision import VisionModel

TOL = 1e-5
# a small limit so the clamps act on many entries (gate above only, up on both sides)
CONFIG = VisionConfig(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=40,
                      projection_intermediate_size=56, swiglu_limit=1.0, rope_theta=100.0, rms_norm_eps=1e-6)
ONE = torch.tensor([[1, 4, 6]])
TWO = torch.tensor([[1, 4, 6], [1, 6, 2]])
WITH_VIDEO = torch.tensor([[1, 2, 4], [2, 4, 2]])    # a two-frame clip: each frame attends alone


def pixels(grid, dim, seed=0):
    return torch.randn(int(grid.prod(-1).sum()), dim, generator=torch.Generator().manual_seed(seed))


def hf_config(config: VisionConfig):
    from transformers import Glm5NextVisionConfig
    d = {k: v for k, v in config.to_hf_dict().items() if k != "model_type"}
    c = Glm5NextVisionConfig(**d)
    c._attn_implementation = "eager"
    return c


@torch.no_grad()
def randomize_all(model, seed=0):
    """Every tensor random (transformers starts norms at one and biases at zero, which a wrong
    implementation could ignore); norm weights stay positive and near one."""
    g = torch.Generator().manual_seed(seed)
    for name, t in model.state_dict().items():
        if "norm" in name and name.endswith("weight"):
            t.copy_(torch.empty(t.shape).uniform_(0.5, 1.5, generator=g))
        else:
            fan_in = t[0].numel() if t.dim() > 1 else 10
            t.copy_(torch.empty(t.shape).normal_(0.0, fan_in ** -0.5, generator=g))
    assert_random(model)


def assert_random(model):
    constant = [n for n, t in model.state_dict().items() if t.numel() > 1 and bool((t == t.flatten()[0]).all())]
    assert not constant, f"constant tensors are never checked: {constant}"


@pytest.fixture(scope="module")
def pair():
    """(transformers tower, ouro tower) with the same random weights."""
    from transformers import Glm5NextVisionModel
    torch.manual_seed(0)
    hf = Glm5NextVisionModel(hf_config(CONFIG)).float().eval()
    randomize_all(hf)
    ours = VisionModel(CONFIG).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)     # same names and shapes, 1:1
    return hf, ours


@torch.no_grad()
def compare(hf, ours, grid, seed=0) -> float:
    x = pixels(grid, ours.config.patch_dim, seed)
    want = hf(x, grid_thw=grid).pooler_output
    got = ours(x, grid)
    assert got.shape == want.shape == (int(grid.prod(-1).sum()) // 4, ours.config.out_hidden_size)
    return rel_rms(got, want)       # inf on NaN


@pytest.mark.parametrize("grid", [ONE, TWO, WITH_VIDEO], ids=["one", "two", "video"])
def test_matches_transformers(pair, grid):
    err = compare(*pair, grid)
    assert err <= TOL, f"rel RMS {err:.2e}"


@torch.no_grad()
def test_images_are_independent_and_split(pair):
    _, ours = pair
    x = pixels(TWO, CONFIG.patch_dim)
    both = ours.split_images(ours(x, TWO), TWO)
    first, second = x.split([24, 12])
    assert [t.shape[0] for t in both] == [6, 3]
    assert rel_rms(both[0], ours(first, TWO[:1])) <= TOL
    assert rel_rms(both[1], ours(second, TWO[1:])) <= TOL


def _no_clamp(monkeypatch, ours):
    for m in ours.modules():
        if hasattr(m, "limit"):
            monkeypatch.setattr(m, "limit", math.inf)


def _swap_rope_axes(monkeypatch, ours):
    positions = ouro_vision.patch_positions
    monkeypatch.setattr(ouro_vision, "patch_positions", lambda g, m: positions(g, m).flip(-1))


def _one_attention_segment(monkeypatch, ours):
    monkeypatch.setattr(ouro_vision, "frame_lengths", lambda g: [int(g.prod(-1).sum())])


@pytest.mark.parametrize("mutate", [_no_clamp, _swap_rope_axes, _one_attention_segment])
def test_comparison_fails_on_a_planted_bug(pair, monkeypatch, mutate):
    hf, ours = pair
    mutate(monkeypatch, ours)
    err = compare(hf, ours, WITH_VIDEO)
    assert err > 100 * TOL, f"{mutate.__name__}: rel RMS {err:.2e}, the comparison cannot see this bug"


def test_vision_config_defaults_and_refusals():
    from transformers import Glm5NextConfig, Glm5NextVisionConfig
    hf = Glm5NextVisionConfig().to_dict()
    mine = VisionConfig.from_hf({})
    for k, v in mine.to_hf_dict().items():
        assert v == hf[k], k
    assert VisionConfig.from_hf({"num_attention_heads": 4, "num_hidden_layers": 3, "rope_theta": 5.0}) == \
        VisionConfig(num_heads=4, depth=3, rope_theta=5.0)
    with pytest.raises(ValueError, match="hidden_act"):
        VisionConfig.from_hf({"hidden_act": "gelu"})
    top = Glm5NextConfig()
    assert all(getattr(ModelConfig(), f) == getattr(top, f) for f in MEDIA_TOKEN_FIELDS)


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_vl")
    make_model("tiny-vl", d, progress=False)
    return d


def test_tiny_vl_preset_loads_like_transformers(tiny_vl):
    from transformers import Glm5NextForConditionalGeneration
    ours = load_vision(tiny_vl)
    assert ours.config == VISION_PRESETS["tiny-vl"]
    assert_random(ours)
    hf = Glm5NextForConditionalGeneration.from_pretrained(tiny_vl, dtype=torch.float32).eval()
    err = compare(hf.model.visual, ours, TWO)
    assert err <= TOL, f"rel RMS {err:.2e}"
    # the text model ignores the tower's tensors and counts them
    assert load_model(tiny_vl).load_report["vision"] == len(ours.state_dict())


def test_tiny_vl_media_tokens(tiny_vl):
    config = ModelConfig.from_hf(tiny_vl)
    assert config == PRESETS["tiny-vl"]
    tokenizer = Tokenizer.from_file(str(tiny_vl / "tokenizer.json"))
    ids = {f: tokenizer.token_to_id(t) for f, t in zip(MEDIA_TOKEN_FIELDS, MEDIA_TOKENS)}
    assert ids == {f: getattr(config, f) for f in MEDIA_TOKEN_FIELDS}
    assert max(ids.values()) < config.vocab_size and len(set(ids.values())) == len(ids)
    on_disk = json.loads((tiny_vl / "config.json").read_text())
    assert on_disk["image_token_id"] == config.image_token_id and on_disk["text_config"].get("image_token_id") is None
    assert tokenizer.encode("<|begin_of_image|><|image|><|end_of_image|>").ids == [
        config.image_start_token_id, config.image_token_id, config.image_end_token_id]


def test_save_and_load_round_trip(pair, tmp_path):
    _, ours = pair
    text = Glm5NextModel(PRESETS["tiny"])
    init_weights(text, seed=1)
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["tiny"].to_hf_dict(CONFIG.to_hf_dict())))
    save_weights(text, tmp_path, vision=ours, max_shard_bytes=100_000)     # sharded: tower split over files
    loaded = load_vision(tmp_path)
    assert loaded.config == CONFIG
    for name, t in ours.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    assert load_model(tmp_path).load_report["vision"] == len(ours.state_dict())


def test_no_tower_gives_none(tmp_path):
    text = Glm5NextModel(PRESETS["tiny"])
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["tiny"].to_hf_dict(CONFIG.to_hf_dict())))
    save_weights(text, tmp_path)
    assert load_vision(tmp_path) is None       # a vision_config but no tensors
    save_weights(text, tmp_path, vision=VisionModel(CONFIG))
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["tiny"].to_hf_dict()))
    assert load_vision(tmp_path) is None       # tensors but an empty vision_config


@pytest.mark.parametrize("edit", ["reshape", "drop"])
def test_bad_tower_tensor_is_named(pair, tmp_path, edit):
    _, ours = pair
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["tiny"].to_hf_dict(CONFIG.to_hf_dict())))
    save_weights(Glm5NextModel(PRESETS["tiny"]), tmp_path, vision=ours)
    name = "model.visual.blocks.1.attn.k_norm.weight"
    tensors = load_file(str(tmp_path / "model.safetensors"))
    if edit == "reshape":
        tensors[name] = tensors[name][:-1].clone()
    else:
        del tensors[name]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError) as e:
        load_vision(tmp_path)
    assert isinstance(e.value, CheckpointError) and name in str(e.value) and "[16]" in str(e.value)
