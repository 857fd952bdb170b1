"""GLM-5.3-Flash (`glm5_next`) text model: wiring only. The pieces live in `ouro.layers`."""

import torch
from torch import nn

from ..config import ModelConfig
from ..layers.context import ForwardContext
from ..layers.dsa import DSAttention
from ..layers.kda import KDAttention
from ..layers.mhc import HyperConnection, HyperHead
from ..layers.moe import MLP, MoE
from ..layers.norm import RMSNorm
from ..layers.linear import Linear
from ..layers.watch import watched


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, kda_chunk_size: int = 16):
        super().__init__()
        self.is_kda = config.layer_types[layer_idx] == "linear_attention"
        self.self_attn = KDAttention(config, layer_idx, kda_chunk_size) if self.is_kda else DSAttention(config, layer_idx)
        self.mlp = MoE(config) if config.mlp_layer_types[layer_idx] == "sparse" else MLP(config, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)

    def forward(self, streams, ctx, selection, weights=None, next_hc=None):
        """weights: this layer's attn_hc output when the previous layer's last mix computed it.
        next_hc: the next layer's attn_hc, whose output this layer's last mix then computes too
        where it can (`HyperConnection.mix_then`): returns (streams, selection, its output or None).
        Without next_hc: (streams, selection)."""
        x, post, comb = weights if weights is not None else self.attn_hc(streams)
        x = self.input_layernorm(x)
        if self.is_kda:
            out = self.self_attn(x, ctx)
        else:
            out, selection = self.self_attn(x, ctx, selection)
        streams, weights = self.attn_hc.mix_then(self.ffn_hc, out, streams, post, comb)
        x, post, comb = weights if weights is not None else self.ffn_hc(streams)
        out = self.mlp(self.post_attention_layernorm(x))
        if next_hc is None:
            return self.ffn_hc.mix(out, streams, post, comb), selection
        streams, weights = self.ffn_hc.mix_then(next_hc, out, streams, post, comb)
        return streams, selection, weights


class Glm5NextModel(nn.Module):
    """Takes a flat batch of new tokens of several sequences (see `ForwardContext`), updates their
    caches in place and returns logits for the rows `ctx.logits_index` asks for."""

    def __init__(self, config: ModelConfig, kda_chunk_size: int = 16):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, kda_chunk_size) for i in range(config.num_hidden_layers))
        self.hc_head = HyperHead()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if ctx.embeds is not None:         # image rows in place of their placeholder tokens' embeddings
            rows, values = ctx.embeds
            x = x.index_copy(0, rows, values.to(x.dtype))
        streams = x.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        selection, weights = None, None
        for layer, nxt in zip(self.layers, [*list(self.layers)[1:], None]):
            # a layer's last mix also computes the next layer's first weights (one fused op) unless
            # either layer is watched: then each runs as written
            if nxt is None or watched(layer, nxt):
                (streams, selection), weights = layer(streams, ctx, selection, weights), None
            else:
                streams, selection, weights = layer(streams, ctx, selection, weights, nxt.attn_hc)
        if getattr(ctx, "keep_hidden", False):    # speculative decoding drafts from every row's final state
            ctx.hidden = self.norm(self.hc_head(streams))
            return self.lm_head(ctx.hidden if ctx.logits_index is None else ctx.hidden[ctx.logits_index])
        if ctx.logits_index is not None:
            streams = streams[ctx.logits_index]
        return self.lm_head(self.norm(self.hc_head(streams)))
