"""The official block-FP8 checkpoint format: written by ouro's own writer from a random glm5_next,
read back by ouro (dequantised tensor by tensor) and by transformers. Where every quantised
dimension is a multiple of the block, transformers is the reference; where blocks are partial the
reference is the dequantisation formula itself, written out block by block here. A mis-shaped or
missing scale is refused with the tensor named."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ouro.lab.reference.checkpoint import make_hf_checkpoint
from tests.helpers.numerics import rel_rms
from ouro.config import CheckpointError
from ouro.engine.simple_runner import SimpleRunner
from ouro.models.fp8_checkpoint import SCALE_SUFFIX, FP8Format
from ouro.models.fp8_writer import write_fp8_checkpoint
from ouro.models.loader import load_model

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 40, 41, 42, 3]


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("float")
    make_hf_checkpoint("tiny", d)
    return d


def _logits(model):
    return SimpleRunner(model, 1, len(PROMPT) + 1, poison=True).step([PROMPT], logits="all")


def _write(src, dest, fmt, stacked_experts=False):
    write_fp8_checkpoint(load_model(src), dest, fmt, stacked_experts=stacked_experts)
    return dest


def _naive_dequantised_copy(fp8_dir, dest, block):
    """Every FP8 tensor of fp8_dir dequantised by the formula, block by block, into an unquantised
    checkpoint at dest (same names, the config without quantization_config)."""
    tensors = {}
    with safe_open(str(fp8_dir / "model.safetensors"), "pt") as h:
        for name in h.keys():
            if name.endswith(SCALE_SUFFIX):
                continue
            t = h.get_tensor(name)
            if t.dtype == torch.float8_e4m3fn:
                s = h.get_tensor(name + SCALE_SUFFIX).float()
                out = torch.full(t.shape, float("nan"))
                bn, bk = block
                for e in range(t.shape[0] if t.dim() == 3 else 1):      # stacked experts: each [N, K]
                    te, se, oe = (t[e], s[e], out[e]) if t.dim() == 3 else (t, s, out)
                    for i in range(se.shape[0]):
                        for j in range(se.shape[1]):
                            rows, cols = slice(i * bn, (i + 1) * bn), slice(j * bk, (j + 1) * bk)
                            oe[rows, cols] = te[rows, cols].float() * se[i, j]
                t = out
            tensors[name] = t
    dest.mkdir()
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp8_dir / "config.json").read_text())
    config.pop("quantization_config")
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def test_whole_blocks_agree_with_transformers_loading_the_same_checkpoint(float_checkpoint, tmp_path):
    """tiny's projections are all multiples of 2 x 16: transformers reads the format itself."""
    from transformers import Glm5NextForConditionalGeneration
    fp8 = _write(float_checkpoint, tmp_path / "fp8", FP8Format(block=(2, 16)))
    config = json.loads((fp8 / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "fp8" and config["weight_block_size"] == [2, 16]
    assert "lm_head" in config["modules_to_not_convert"]
    with safe_open(str(fp8 / "model.safetensors"), "pt") as h:
        fp8_names = [k for k in h.keys() if h.get_slice(k).get_dtype() == "F8_E4M3"]
    assert any("experts.0.gate_proj" in k for k in fp8_names) and any("self_attn.q_proj" in k for k in fp8_names)
    ours = _logits(load_model(fp8))
    hf = Glm5NextForConditionalGeneration.from_pretrained(fp8, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float()
    assert rel_rms(ours, ref) < 5e-6
    assert rel_rms(ours, _logits(load_model(float_checkpoint))) > 1e-4     # FP8 did change the weights


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float8_e8m0fnu])
def test_partial_blocks_follow_the_dequantisation_formula(float_checkpoint, tmp_path, scale_dtype):
    """128 x 128 blocks on tiny: every block is partial at the edges (and most weights are one
    partial block); ouro must equal the formula exactly."""
    fmt = FP8Format(block=(128, 128), scale_dtype=scale_dtype)
    fp8 = _write(float_checkpoint, tmp_path / "fp8", fmt)
    with safe_open(str(fp8 / "model.safetensors"), "pt") as h:
        scale = h.get_tensor("model.language_model.layers.0.self_attn.q_proj.weight" + SCALE_SUFFIX)
    assert scale.dtype == scale_dtype and scale.shape == (1, 1)
    naive = _naive_dequantised_copy(fp8, tmp_path / "naive", fmt.block)
    assert torch.equal(_logits(load_model(fp8)), _logits(load_model(naive)))


def test_stacked_expert_tensors_load_by_the_formula(float_checkpoint, tmp_path):
    """Routed experts stored stacked ([E, N, K] weights, [E, ceil(N/bn), ceil(K/bk)] scales, partial
    blocks at the edges): ouro equals the formula applied expert by expert, and the unquantised
    stacked copy the formula makes loads too (the loader takes either expert layout)."""
    fmt = FP8Format(block=(48, 20))
    fp8 = _write(float_checkpoint, tmp_path / "fp8", fmt, stacked_experts=True)
    name = "model.language_model.layers.1.mlp.experts.gate_up_proj"
    with safe_open(str(fp8 / "model.safetensors"), "pt") as h:
        w, s = h.get_tensor(name), h.get_tensor(name + SCALE_SUFFIX)
        assert not any(".experts.0." in k for k in h.keys())
    assert w.dtype == torch.float8_e4m3fn and s.shape == (w.shape[0], -(-w.shape[1] // 48), -(-w.shape[2] // 20))
    naive = _naive_dequantised_copy(fp8, tmp_path / "naive", fmt.block)
    ours = _logits(load_model(fp8))
    assert torch.isfinite(ours).all()
    assert torch.equal(ours, _logits(load_model(naive)))
    per_expert = _write(float_checkpoint, tmp_path / "per_expert", FP8Format(block=(1, 1)))
    stacked_fine = _write(float_checkpoint, tmp_path / "stacked_fine", FP8Format(block=(1, 1)), stacked_experts=True)
    assert torch.equal(_logits(load_model(per_expert)), _logits(load_model(stacked_fine)))   # 1x1 blocks: same values
    wrong = _rewrite(fp8, tmp_path / "wrong", lambda t: t.update({name + SCALE_SUFFIX: s[:, :-1].contiguous()}))
    with pytest.raises(CheckpointError, match=rf"scale {name}{SCALE_SUFFIX} has shape .* expected"):
        load_model(wrong)


def _rewrite(fp8, dest, edit):
    shutil.copytree(fp8, dest)
    with safe_open(str(dest / "model.safetensors"), "pt") as h:
        tensors = {k: h.get_tensor(k) for k in h.keys()}
    edit(tensors)
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def test_a_bad_or_missing_scale_is_named(float_checkpoint, tmp_path):
    fp8 = _write(float_checkpoint, tmp_path / "fp8", FP8Format(block=(2, 16)))
    name = "model.language_model.layers.1.mlp.experts.3.down_proj.weight"
    wrong = _rewrite(fp8, tmp_path / "wrong", lambda t: t.update({name + SCALE_SUFFIX: torch.ones(3, 3)}))
    with pytest.raises(CheckpointError, match=rf"scale {name}{SCALE_SUFFIX} has shape \[3, 3\], expected"):
        load_model(wrong)
    missing = _rewrite(fp8, tmp_path / "missing", lambda t: t.pop(name + SCALE_SUFFIX))
    with pytest.raises(CheckpointError, match=rf"FP8 tensor {name} has no"):
        load_model(missing)
    unconfigured = _rewrite(fp8, tmp_path / "unconfigured", lambda t: None)
    config = json.loads((unconfigured / "config.json").read_text())
    config.pop("quantization_config")
    (unconfigured / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="no quantization_config"):
        load_model(unconfigured)
    other = _rewrite(fp8, tmp_path / "other", lambda t: None)
    config = json.loads((other / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "awq"
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="'awq' is not supported"):
        load_model(other)
