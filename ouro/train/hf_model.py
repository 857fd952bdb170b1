"""The differentiable model: transformers' glm5_next trunk built from an ouro `ModelConfig`, with
the MTP draft block as an extra decoder layer at index `num_hidden_layers`.

transformers' text model runs only `layers[:config.num_hidden_layers]`, so the MTP block can live
in the same `ModuleList`: `save_pretrained` then writes it as `model.language_model.layers.N.*`
(experts in the on-disk per-expert layout), the place the official checkpoint has it.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig

DSA = "indexed_attention"
# the tiny vision tower transformers needs to build the full model class (never trained)
VISION = {"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "projection_intermediate_size": 64}


def require_transformers():
    try:
        import transformers  # noqa: F401
        from transformers import Glm5NextConfig  # noqa: F401
    except ImportError as e:
        raise SystemExit("ouro train needs transformers >= 5.24: pip install -e '.[train]'") from e


def hf_modeling():
    from transformers.models.glm5_next import modeling_glm5_next
    return modeling_glm5_next


def use_ouro_kda(chunk_size: int = 16) -> None:
    """Run transformers' KDA layers on ouro's chunked kernel (`ouro.ops.kda.kda_chunk`, written
    to be differentiable in O(chunks)). transformers' own torch fallback indexes and assigns one
    chunk at a time, so its backward pass re-touches the whole tensor per chunk; at 512 tokens
    that was most of a training step. The two agree to fp32 noise in value and gradient
    (tests/train/test_train.py)."""
    m = hf_modeling()
    base = getattr(m.chunk_kimi_delta_attention, "_ouro_base", m.chunk_kimi_delta_attention)

    def chunk_kda(query, key, value, g, beta, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, **kwargs):
        from ..ops.kda.chunk import kda_chunk
        dtype = query.dtype
        q, k = query.float(), key.float()
        if use_qk_l2norm_in_kernel:
            q, k = m.l2norm(q, dim=-1, eps=1e-6), m.l2norm(k, dim=-1, eps=1e-6)
        q = q * q.shape[-1] ** -0.5
        out, state = kda_chunk(q, k, value, g, beta, initial_state=initial_state, chunk_size=chunk_size)
        return out.to(dtype), (state if output_final_state else None)

    chunk_kda._ouro_base = base
    m.chunk_kimi_delta_attention = chunk_kda


def use_transformers_kda() -> None:
    m = hf_modeling()
    m.chunk_kimi_delta_attention = getattr(m.chunk_kimi_delta_attention, "_ouro_base", m.chunk_kimi_delta_attention)


def build_model(config: ModelConfig, mtp: bool = True, seed: int = 0):
    """A float32 `Glm5NextForConditionalGeneration` for `config`, randomly initialised from
    `seed`, with the MTP block at `layers[N]` when `mtp`."""
    require_transformers()
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration
    n = config.num_hidden_layers
    text = config.to_text_config()
    if mtp:   # built as one more layer (a DSA block with its own indexer and MoE), then hidden
        text.update(num_hidden_layers=n + 1, layer_types=list(config.layer_types) + [DSA],
                    mlp_layer_types=list(config.mlp_layer_types) + ["sparse"],
                    indexer_types=list(config.indexer_types) + ["full"])
    hf_config = Glm5NextConfig(text_config=text, vision_config=dict(VISION, out_hidden_size=config.hidden_size),
                               tie_word_embeddings=config.tie_word_embeddings)
    torch.manual_seed(seed)
    model = Glm5NextForConditionalGeneration(hf_config).float()
    if mtp:
        tc = model.config.text_config
        tc.num_hidden_layers = n
        block = model.model.language_model.layers[n]
        rms = hf_modeling().Glm5NextTextRMSNorm
        h = config.hidden_size
        block.enorm, block.hnorm = rms(h, config.rms_norm_eps), rms(h, config.rms_norm_eps)
        block.eh_proj = nn.Linear(2 * h, h, bias=False)
        block.shared_head = nn.Module()
        block.shared_head.norm = rms(h, config.rms_norm_eps)
        nn.init.normal_(block.eh_proj.weight, std=tc.initializer_range)
    return model


def trunk(model):
    return model.model.language_model


def mtp_block(model):
    layers = trunk(model).layers
    n = model.config.text_config.num_hidden_layers
    return layers[n] if len(layers) > n else None


def dsa_attentions(model) -> list[tuple[str, nn.Module]]:
    """(name, attention module) of every DSA layer with its own indexer, MTP block included."""
    out = []
    for i, layer in enumerate(trunk(model).layers):
        attn = layer.self_attn
        if getattr(attn, "indexer", None) is not None:
            out.append((f"layer{i}", attn))
    return out


def routers(model) -> list[nn.Module]:
    cls = hf_modeling().Glm5NextTextTopkRouter
    return [m for m in trunk(model).modules() if isinstance(m, cls)]


def forward_with_mtp(model, input_ids: torch.Tensor, use_mtp: bool = True):
    """Trunk logits [B, S, V] and, with an MTP block, MTP logits [B, S-1, V] where position t
    (fed the trunk's hidden state at t and the embedding of token t+1) predicts token t+2."""
    tm = trunk(model)
    out = tm(input_ids=input_ids)
    hidden = out.last_hidden_state                       # after the final norm
    logits = model.lm_head(hidden)
    block = mtp_block(model) if use_mtp else None
    if block is None or input_ids.shape[1] < 2:
        return logits, None
    mtp_hidden = mtp_forward(model, block, hidden[:, :-1], input_ids[:, 1:])
    return logits, model.lm_head(mtp_hidden)


def mtp_forward(model, block, hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    """One MTP step: normed next-token embedding and normed trunk state -> eh_proj -> the
    decoder block on hc_mult copies -> mean of the streams -> shared_head.norm."""
    tm = trunk(model)
    e = block.enorm(tm.embed_tokens(next_ids))
    h = block.hnorm(hidden)
    x = block.eh_proj(torch.cat([e, h], dim=-1))
    hc = model.config.text_config.hc_mult
    streams = x.unsqueeze(2).expand(-1, -1, hc, -1).contiguous()
    b, s = next_ids.shape
    mask = torch.ones(b, s, dtype=torch.bool, device=next_ids.device)
    pos = torch.arange(s, device=next_ids.device)[None]
    streams, _ = block(streams, attention_mask=mask, position_ids=pos, position_embeddings=None)
    return block.shared_head.norm(streams.mean(dim=2))
