"""The glm5_next vision tower's modules: patch embedding, 2-D axial rope, attention within each
image (qk RMSNorm per head), the clamped SwiGLU MLP, the pre-norm block and the patch merger.
Parameter names and shapes are transformers' (`model.visual.*` maps 1:1)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config.model import VisionConfig
from ..ops.moe import clamped_swiglu
from .linear import Linear
from .moe import MLP
from .norm import RMSNorm


class PatchProjection(nn.Conv3d):
    """transformers' Conv3d (`patch_embed.proj`), whose kernel covers the whole patch: one matrix
    product over the flattened patch [N, C*T*P*P] -> [N, hidden]."""

    def forward(self, pixels):
        w = self.weight
        return F.linear(pixels.to(w.dtype), w.flatten(1), self.bias)


class PatchEmbed(nn.Module):
    """One patch (C x T x P x P values, flattened) -> hidden."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = PatchProjection(config.in_channels, config.hidden_size, kernel_size=kernel, stride=kernel)

    def forward(self, pixels):
        return self.proj(pixels)


class PatchDownsample(nn.Conv2d):
    """The 2x2 (merge x merge) spatial merge, transformers' `downsample` Conv2d: each merge x merge
    block of consecutive patches [N, hidden] (the processor's order) -> one token [N / merge^2,
    out_hidden]. The kernel covers the block, so it is one product over the block's (channel, row,
    column) values. The grouping into blocks happens here, so the lab names the whole merge."""

    def forward(self, x):
        m = self.kernel_size[0]
        blocks = x.view(-1, m, m, x.shape[-1]).permute(0, 3, 1, 2).flatten(1)
        return F.linear(blocks, self.weight.flatten(1), self.bias)


def patch_positions(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """(row, column) of every patch [N, 2], in the processor's order: each image's merge x merge
    blocks one after another (row-major over blocks and within a block), repeated per frame."""
    out = []
    for t, h, w in grid_thw.tolist():
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        pos = torch.stack([rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()], dim=-1)
        out.append(pos.repeat(t, 1))
    return torch.cat(out).to(grid_thw.device)


def frame_lengths(grid_thw: torch.Tensor) -> list[int]:
    """Patches per attention segment: every frame of every image attends only within itself."""
    return [h * w for t, h, w in grid_thw.tolist() for _ in range(t)]


class AxialRope(nn.Module):
    """Rotary angles of a patch: a quarter of each head's frequencies on its row, a quarter on its
    column, laid out [row, column, row, column] so a rotate-half pairs each angle with itself."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        quarter = config.head_dim // 2
        inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float32) / quarter)
        self.register_buffer("inv_freq", inv_freq, persistent=False)   # not a checkpoint tensor

    def forward(self, positions):
        angles = (positions[..., None].float() * self.inv_freq).flatten(1)   # [N, 2 * head_dim/4]
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()


def rotate(x, cos, sin):
    """Rotate-half rope in float32; x [N, heads, head_dim], cos/sin [N, head_dim]."""
    half = x.shape[-1] // 2
    xf = x.float()
    turned = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos[:, None] + turned * sin[:, None]).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        D = config.hidden_size
        self.heads, self.head_dim = config.num_heads, config.head_dim
        self.qkv = Linear(D, 3 * D, bias=config.attention_bias)
        self.proj = Linear(D, D, bias=config.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x, rope, lengths: list[int]):
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, self.head_dim).unbind(1)
        q, k = rotate(self.q_norm(q), *rope), rotate(self.k_norm(k), *rope)
        # bidirectional attention inside each frame; frames never see each other
        out = [F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in qkv)).transpose(0, 1)
               for qkv in zip(q.split(lengths), k.split(lengths), v.split(lengths))]
        return self.proj(torch.cat(out).reshape(n, -1))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.norm1 = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm2 = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = VisionAttention(config)
        self.mlp = MLP(config, config.intermediate_size, bias=config.attention_bias)

    def forward(self, x, rope, lengths: list[int]):
        x = x + self.attn(self.norm1(x), rope, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """A merged patch (already out_hidden_size wide) -> the text model's embedding: a projection,
    LayerNorm, GELU, then a clamped SwiGLU; no biases but the LayerNorm's."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        D, I = config.out_hidden_size, config.projection_intermediate_size
        self.proj = Linear(D, D, bias=False)
        self.post_projection_norm = nn.LayerNorm(D)
        self.act1 = nn.GELU()            # a module, as transformers' `merger.act1`: the lab names it
        self.gate_proj = Linear(D, I, bias=False)
        self.up_proj = Linear(D, I, bias=False)
        self.down_proj = Linear(I, D, bias=False)
        self.limit = config.swiglu_limit

    def forward(self, x):
        x = self.act1(self.post_projection_norm(self.proj(x)))
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))
