"""`VisionModel`: the glm5_next vision tower (transformers' `Glm5NextVisionModel`), from flattened
patches to the embeddings that replace an image's placeholder tokens. Its state dict is the
checkpoint's `model.visual.*` with the prefix removed."""

from __future__ import annotations

import torch
from torch import nn

from ..config.model import VisionConfig
from ..layers.norm import RMSNorm
from ..layers.vision import (AxialRope, PatchDownsample, PatchEmbed, PatchMerger, VisionBlock, frame_lengths,
                             patch_positions)


class VisionModel(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        m = config.spatial_merge_size
        self.patch_embed = PatchEmbed(config)
        self.rotary_pos_emb = AxialRope(config)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.post_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.downsample = PatchDownsample(config.hidden_size, config.out_hidden_size, kernel_size=m, stride=m)
        self.merger = PatchMerger(config)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C*T*P*P] (the processor's patch order), grid_thw [n, 3] (frames, rows and
        columns of patches per image) -> [N / merge^2, out_hidden_size], images back to back."""
        m = self.config.spatial_merge_size
        self._check(pixel_values, grid_thw)
        rope = self.rotary_pos_emb(patch_positions(grid_thw, m).to(pixel_values.device))
        lengths = frame_lengths(grid_thw)
        x = self.patch_embed(pixel_values)
        for block in self.blocks:
            x = block(x, rope, lengths)
        x = self.post_layernorm(x)
        return self.merger(self.downsample(x))     # each merge x merge block of patches -> one token

    def _check(self, pixel_values, grid_thw):
        c, m = self.config, self.config.spatial_merge_size
        if pixel_values.dim() != 2 or pixel_values.shape[1] != c.patch_dim:
            raise ValueError(f"pixel_values must be [patches, {c.patch_dim}], got {list(pixel_values.shape)}")
        if grid_thw.dim() != 2 or grid_thw.shape[1] != 3 or bool((grid_thw < 1).any()):
            raise ValueError(f"grid_thw must be [images, 3] of positive (t, h, w), got {grid_thw.tolist()}")
        if bool((grid_thw[:, 1:] % m).any()):
            raise ValueError(f"every grid's h and w must be multiples of spatial_merge_size {m}: {grid_thw.tolist()}")
        if int(grid_thw.prod(-1).sum()) != pixel_values.shape[0]:
            raise ValueError(f"grid_thw {grid_thw.tolist()} covers {int(grid_thw.prod(-1).sum())} patches, "
                             f"pixel_values has {pixel_values.shape[0]}")

    def tokens_per_image(self, grid_thw: torch.Tensor) -> list[int]:
        """Embeddings each image (or video) yields: its patches / merge^2."""
        return (grid_thw.prod(-1) // self.config.spatial_merge_size ** 2).tolist()

    def split_images(self, embeddings: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """The forward's output cut into one tensor per image."""
        return list(embeddings.split(self.tokens_per_image(grid_thw)))
