"""Helpers that build reference checkpoints with transformers itself and run its model."""

from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from numerics import rel_rms  # noqa: F401  (re-exported for model tests)
from ouro.config import ModelConfig
from ouro.models.presets import condition_indexer

KDA, DSA = "linear_attention", "indexed_attention"

# The `tiny` preset's shape, and a second shape with shared indexer layers, 2 indexer heads,
# kpool 4 and several experts per group (two layers use their own indexer, two reuse it).
SHAPES = {
    "tiny": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=8, n_group=2, topk_group=1,
        num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16,
        index_topk=16, index_head_dim=16, index_n_heads=2, index_kpool=4, linear_head_dim=16, linear_num_heads=2,
        layer_types=[KDA, KDA, KDA, DSA], mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        indexer_types=["full"] * 4, pad_token_id=0),
    "shared": dict(
        vocab_size=384, hidden_size=96, intermediate_size=160, moe_intermediate_size=48, num_hidden_layers=6,
        num_attention_heads=3, num_key_value_heads=3, n_routed_experts=12, n_group=3, topk_group=2,
        num_experts_per_tok=3, kv_lora_rank=24, q_lora_rank=40, qk_nope_head_dim=16, v_head_dim=24,
        index_topk=24, index_head_dim=16, index_n_heads=2, index_kpool=4, linear_head_dim=16, linear_num_heads=3,
        layer_types=[KDA, DSA, DSA, KDA, DSA, DSA], mlp_layer_types=["dense", "dense"] + ["sparse"] * 4,
        indexer_types=["full", "full", "shared", "full", "full", "shared"], pad_token_id=0),
}

VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
              projection_intermediate_size=64)


def make_hf_checkpoint(shape: str, directory, seed: int = 0):
    """Random-init a transformers Glm5NextForConditionalGeneration and save_pretrained it (fp32)."""
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration
    text = SHAPES[shape]
    cfg = Glm5NextConfig(text_config=text, vision_config=dict(VISION, out_hidden_size=text["hidden_size"]))
    torch.manual_seed(seed)
    model = Glm5NextForConditionalGeneration(cfg).float().eval()
    # give the random router's correction bias and mHC biases non-trivial values, so they are checked
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("attn_hc.base", "ffn_hc.base")):
                p.normal_(0.0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.05)
    params = {n.replace("model.language_model.", "", 1) if n.startswith("lm_head") else n: p
              for n, p in model.named_parameters()}
    params.update(dict(model.named_buffers()))
    condition_indexer(params, ModelConfig.from_dict(text), prefix="model.language_model.")
    model.save_pretrained(directory)
    # the checkpoint must describe the shape asked for, as ouro reads it
    saved = ModelConfig.from_hf(directory)
    assert saved.layer_types == tuple(text["layer_types"]) and saved.indexer_types == tuple(text["indexer_types"])
    return model
