"""`ouro plan` for a checkpoint with a vision tower: the tower's weights, and what one image costs
(its patches and tokens after the processor's resize, and the tower's working set for it)."""

from __future__ import annotations

import torch

from ..config.model import VisionConfig


def tower_parameters(config: VisionConfig) -> int:
    """Parameters of the tower (built on the meta device: shapes only)."""
    from ..models.vision import VisionModel
    with torch.device("meta"):
        return sum(p.numel() for p in VisionModel(config).parameters())


def image_cost(config: VisionConfig, height: int, width: int, dtype=torch.bfloat16) -> dict:
    """Patches, tokens and the tower's peak working set for one image of this size: the block's
    hidden states (input, norm, q/k/v, attention output), the MLP's gate/up/down, and one head's
    attention scores over the image's patches at a time in float32 (the attention runs per image)."""
    from ..models.image_processor import ImageProcessor
    proc = ImageProcessor(patch_size=config.patch_size, temporal_patch_size=config.temporal_patch_size,
                          merge_size=config.spatial_merge_size)
    t, h, w = proc.grid(height, width)
    n = t * h * w
    e = torch.empty(0, dtype=dtype).element_size()
    hidden = 6 * n * config.hidden_size * e
    mlp = 3 * n * config.intermediate_size * e
    scores = config.num_heads * n * (n // t) * 4
    return {"grid": (t, h, w), "patches": n, "tokens": n // config.spatial_merge_size ** 2,
            "pixel_bytes": n * config.patch_dim * 4, "activation_bytes": hidden + mlp + scores}


def vision_config_of(model: str) -> VisionConfig | None:
    """A preset's tower (`flash`: the published dimensions, transformers' defaults), or a
    checkpoint's `vision_config`; None for a text-only preset."""
    import json
    from pathlib import Path

    from ..models.presets import PRESETS, VISION_PRESETS
    if model in PRESETS:
        return VISION_PRESETS.get(model, VisionConfig() if model == "flash" else None)
    d = json.loads((Path(model) / "config.json").read_text()).get("vision_config") or {}
    return VisionConfig.from_hf(d) if d else None


def format_vision_plan(name: str, config: VisionConfig, sizes: list[tuple[int, int]], dtype=torch.bfloat16) -> str:
    e = torch.empty(0, dtype=dtype).element_size()
    n = tower_parameters(config)
    lines = [f"{name} vision tower: {config.depth} blocks of {config.hidden_size} ({config.num_heads} heads), "
             f"{n / 1e6:,.1f}M parameters = {n * e / 2**30:,.3f} GiB in {str(dtype).replace('torch.', '')}"]
    for h, w in sizes:
        c = image_cost(config, h, w, dtype)
        t, gh, gw = c["grid"]
        lines.append(f"  image {w}x{h}: grid {gh}x{gw} patches -> {c['tokens']:,} tokens; pixel values "
                     f"{c['pixel_bytes'] / 2**20:,.1f} MiB; tower working set {c['activation_bytes'] / 2**20:,.1f} MiB")
    return "\n".join(lines)
