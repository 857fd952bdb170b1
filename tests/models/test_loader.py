"""Checkpoint reading and writing: layout round trips, sharding, and clear errors."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.numerics import rel_rms
from ouro.config import CheckpointError, ModelConfig
from ouro.engine.simple_runner import SimpleRunner
from ouro.models.glm5_next import Glm5NextModel
from ouro.models.loader import load_model, load_weights, save_weights
from ouro.models.presets import PRESETS, init_weights


@pytest.fixture()
def tiny_dir(tmp_path):
    model = Glm5NextModel(PRESETS["tiny"])
    init_weights(model, seed=1)
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["tiny"].to_hf_dict()))
    save_weights(model, tmp_path)
    return tmp_path, model


def edit(directory, fn):
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path))


def test_round_trip_is_exact(tiny_dir):
    d, model = tiny_dir
    loaded = load_model(d)
    for (n, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), n


def test_sharded_checkpoint_loads(tiny_dir, tmp_path_factory):
    _, model = tiny_dir
    d = tmp_path_factory.mktemp("sharded")
    (d / "config.json").write_text(json.dumps(PRESETS["tiny"].to_hf_dict()))
    paths = save_weights(model, d, max_shard_bytes=200_000)
    assert len(paths) > 1 and (d / "model.safetensors.index.json").is_file()
    loaded = load_model(d)
    ids = list(range(40))
    a = SimpleRunner(model, 1, 64).step([ids], logits="all")
    b = SimpleRunner(loaded, 1, 64).step([ids], logits="all")
    assert rel_rms(b, a) == 0.0


def test_missing_tensor_is_named(tiny_dir):
    d, _ = tiny_dir
    name = "model.language_model.layers.1.mlp.experts.3.up_proj.weight"
    edit(d, lambda t: t.pop(name))
    with pytest.raises(CheckpointError) as e:
        load_model(d)
    assert name in str(e.value) and "missing" in str(e.value) and "[32, 64]" in str(e.value)


def test_wrong_shape_is_named(tiny_dir):
    d, _ = tiny_dir
    name = "model.language_model.layers.3.self_attn.kv_b_proj.weight"
    edit(d, lambda t: t.__setitem__(name, torch.zeros(3, 3)))
    with pytest.raises(CheckpointError) as e:
        load_model(d)
    msg = str(e.value)
    assert name in msg and "[3, 3]" in msg and "expected [64, 16]" in msg


def test_unexpected_tensor_is_named_and_vision_mtp_are_reported(tiny_dir):
    d, _ = tiny_dir
    edit(d, lambda t: t.update({"model.visual.patch_embed.proj.weight": torch.zeros(2),
                                "model.language_model.layers.4.eh_proj.weight": torch.zeros(64, 128),
                                "model.language_model.layers.4.self_attn.q_a_proj.weight": torch.zeros(2)}))
    model = load_model(d)
    assert model.load_report == {"vision": 1, "mtp": 2}      # the MTP block's own tensors are counted
    edit(d, lambda t: t.update({"model.language_model.layers.4.eh_proj.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"MTP tensor .*layers\.4\.eh_proj\.weight has shape \[2\], expected \[64, 128\]"):
        load_model(d)                                        # its head tensors are checked
    edit(d, lambda t: t.update({"model.language_model.layers.4.eh_proj.weight": torch.zeros(64, 128)}))
    edit(d, lambda t: t.update({"model.language_model.layers.0.self_attn.surprise": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor model\.language_model\.layers\.0\.self_attn\.surprise"):
        load_model(d)


def test_wrong_model_type(tiny_dir):
    d, _ = tiny_dir
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "llama"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="model_type is 'llama'"):
        load_model(d)


def test_missing_config_and_weights(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["tiny"].to_hf_dict()))
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_model(tmp_path)


def test_loading_does_not_double_memory(tmp_path):
    """Peak extra memory while loading stays near one tensor, not the checkpoint size: loading
    goes tensor by tensor into the already-built model."""
    cfg = PRESETS["tiny"]
    model = Glm5NextModel(cfg)
    init_weights(model)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    save_weights(model, tmp_path)
    target = Glm5NextModel(cfg)
    biggest = max(t.numel() for t in target.state_dict().values())
    seen = []
    orig = torch.Tensor.copy_

    def spy(self, src, *a, **k):
        seen.append(src.numel())
        return orig(self, src, *a, **k)
    torch.Tensor.copy_ = spy
    try:
        load_weights(target, tmp_path)
    finally:
        torch.Tensor.copy_ = orig
    assert max(seen) <= biggest  # never more than one model tensor in flight
    total = sum(t.numel() for t in target.state_dict().values())
    assert sum(seen) == total  # every element written once, one tensor at a time


def test_config_from_flat_and_nested_dicts():
    nested = PRESETS["tiny"].to_hf_dict()
    flat = dict(nested["text_config"], model_type="glm5_next")
    assert ModelConfig.from_dict(nested) == ModelConfig.from_dict(flat) == PRESETS["tiny"]
    with pytest.raises(CheckpointError, match="qk_rope_head_dim"):
        ModelConfig.from_dict(dict(flat, qk_rope_head_dim=64))


@pytest.mark.processes
def test_loading_leaves_torch_init_alone_and_does_not_import_dynamo():
    """The meta-device skeleton is built for shapes only: torch's init functions are restored after it
    (a model built next is initialised), and a fresh process loading a model does not import
    torch._dynamo (1.4 s of every `ouro serve` start on the AVX2 machine)."""
    import os
    import subprocess
    import sys
    init = {n: getattr(torch.nn.init, n) for n in ("normal_", "uniform_", "kaiming_uniform_", "zeros_")}
    from ouro.models.resolve import resolve_model
    load_model(resolve_model("tiny-py"))
    assert {n: getattr(torch.nn.init, n) for n in init} == init
    assert torch.nn.Linear(4, 4).weight.abs().sum() > 0
    code = ("import sys; from ouro.models.loader import load_model; from ouro.models.resolve import resolve_model; "
            "load_model(resolve_model('tiny-py')); print('DYNAMO', 'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert "DYNAMO False" in out.stdout, out.stdout + out.stderr[-2000:]
