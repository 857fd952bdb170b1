"""The MTP draft layer against transformers: a random glm5_next with its MTP block (built as the
trainer builds it, every weight randomised), saved in the checkpoint layout; ouro's trunk and
draft layer over a whole sequence must give the trainer's reference MTP logits
(`train.hf_model.forward_with_mtp`: position t, fed the trunk's state at t and token t+1,
predicts token t+2)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.numerics import rel_rms
from ouro.config import CheckpointError, ModelConfig
from ouro.layers.context import ForwardContext, ModelCache


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    from ouro.models.presets import PRESETS
    from ouro.train.hf_model import build_model
    from ouro.train.hf_model import VISION
    config = PRESETS["tiny"]
    model = build_model(config, mtp=True, seed=3)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if "norm" in name and p.dim() == 1 else 0.08 * noise)
    d = tmp_path_factory.mktemp("mtp")
    model.save_pretrained(d, safe_serialization=True)
    hf = config.to_hf_dict(dict(VISION, out_hidden_size=config.hidden_size))
    hf["text_config"]["num_nextn_predict_layers"] = 1
    (d / "config.json").write_text(json.dumps(hf))
    return d, model.eval()


def ouro_mtp_logits(directory, ids):
    from ouro.models.loader import load_model
    from ouro.models.mtp import load_mtp
    trunk = load_model(directory)
    layer = load_mtp(directory, trunk.config)
    cache = ModelCache(trunk.config.with_mtp_layer(), 1, 8, 16)
    cache.poison()
    ctx = ForwardContext.build(cache, [len(ids)], [0], [0], [list(range(8))], logits="all")
    ctx.keep_hidden = True
    trunk_logits = trunk(torch.tensor(ids), ctx)
    mctx = ForwardContext.build(cache, [len(ids) - 1], [0], [0], [list(range(8))], logits="all")
    h = layer.draft_hidden(trunk.embed_tokens(torch.tensor(ids[1:])), ctx.hidden[:-1], mctx)
    return trunk_logits, trunk.lm_head(h)


def test_the_draft_layer_equals_the_trainers_reference(mtp_checkpoint):
    from ouro.train.hf_model import forward_with_mtp
    directory, hf = mtp_checkpoint
    ids = [5, 9, 17, 3, 40, 41, 7, 7, 12, 60, 2, 33, 18, 21]
    trunk_logits, mtp_logits = ouro_mtp_logits(directory, ids)
    with torch.no_grad():
        ref_trunk, ref_mtp = forward_with_mtp(hf, torch.tensor([ids]))
    assert not torch.isnan(mtp_logits).any()
    assert rel_rms(trunk_logits, ref_trunk[0]) < 1e-5
    assert rel_rms(mtp_logits, ref_mtp[0]) < 1e-5
    assert rel_rms(mtp_logits, trunk_logits[1:]) > 0.1          # a different head, not the trunk again


def test_a_checkpoint_without_an_mtp_layer_is_refused(tmp_path):
    from ouro.lab.reference.checkpoint import make_hf_checkpoint
    from ouro.models.mtp import load_mtp
    make_hf_checkpoint("tiny", tmp_path)
    with pytest.raises(CheckpointError, match="has no MTP layer"):
        load_mtp(tmp_path, ModelConfig.from_hf(tmp_path))
