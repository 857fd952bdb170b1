"""The MTP draft layer (`layers.{num_hidden_layers}` of a glm5_next checkpoint): the next-next
token from the trunk's final hidden state and the next token.

One step at position p: e = enorm(embed(token p+1)), h = hnorm(hidden p), x = eh_proj([e, h]),
the decoder block (DSA attention with its own indexer over the draft layer's own cache rows, a
routed MoE) on hc_mult copies of x, the mean of the streams, shared_head.norm, the trunk's
lm_head. Drafting K tokens runs it K times, each step fed its own previous output as `hidden`
(hnorm normalises it again, as GLM does). The embeddings and lm_head are the trunk's."""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .glm5_next import DecoderLayer
from ..layers.linear import Linear
from ..layers.norm import RMSNorm


class SharedHead(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MTPLayer(DecoderLayer):
    """A decoder layer of the config extended by `with_mtp_layer`, with the MTP head's own tensors."""

    def __init__(self, trunk_config: ModelConfig):
        config = trunk_config.with_mtp_layer()
        super().__init__(config, trunk_config.num_hidden_layers)
        h = config.hidden_size
        self.hc_mult = config.hc_mult
        self.enorm = RMSNorm(h, config.rms_norm_eps)
        self.hnorm = RMSNorm(h, config.rms_norm_eps)
        self.eh_proj = Linear(2 * h, h, bias=False)
        self.shared_head = SharedHead(config)

    def draft_hidden(self, embeds, hidden, ctx):
        """embeds [T, D] (the next tokens' embeddings), hidden [T, D] (the trunk's final hidden
        state, or the previous draft step's output) -> the draft hidden state [T, D]; writes the
        draft layer's cache rows at ctx's positions."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden.to(embeds.dtype))], dim=-1))
        streams = x.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        streams, _ = super().forward(streams, ctx, None)
        return self.shared_head.norm(streams.mean(1))


class MTPHolder(nn.Module):
    """Holds the draft layer under the checkpoint's name (`layers.N`) so the loader's one table maps
    its tensors; `config` is the trunk's."""

    def __init__(self, trunk_config: ModelConfig):
        super().__init__()
        self.config = trunk_config
        self.layers = nn.ModuleDict({str(trunk_config.num_hidden_layers): MTPLayer(trunk_config)})

    @property
    def layer(self) -> MTPLayer:
        return self.layers[str(self.config.num_hidden_layers)]


def load_mtp(directory, trunk_config: ModelConfig, dtype=torch.float32, device="cpu") -> MTPLayer:
    """The checkpoint's MTP layer, loaded tensor by tensor (block-FP8 ones dequantised). Raises
    CheckpointError if the checkpoint has none or a tensor is missing or mis-shaped."""
    from ..config import CheckpointError
    from .loader import load_weights
    if not trunk_config.has_mtp:
        raise CheckpointError(f"{directory}: the checkpoint has no MTP layer (num_nextn_predict_layers is 0 or "
                              "unset): speculative decoding with NEXTN needs one")
    with torch.device(device):
        holder = MTPHolder(trunk_config).to(dtype)
    load_weights(holder, directory, partial=True)
    return holder.layer.eval()
