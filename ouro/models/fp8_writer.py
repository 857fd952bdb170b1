"""ouro's writer of the block-FP8 checkpoint format (`fp8_checkpoint`): any built model saved with
its projections in e4m3 and their block scales, config.json declaring quantization_config."""

from __future__ import annotations

import json
from pathlib import Path

from .fp8_checkpoint import SCALE_SUFFIX, FP8Format, converts, quantize
from .loader import save_weights


def write_fp8_checkpoint(model, directory, fmt: FP8Format | None = None, mtp_layers: tuple[int, ...] = (),
                         stacked_experts: bool = False) -> None:
    """Write `model` as a block-FP8 checkpoint: every projection in e4m3 with its block scales,
    the rest (and the MTP layers `mtp_layers`) as they are; config.json gets quantization_config.
    `stacked_experts`: routed experts as [E, N, K] tensors with [E, ceil(N/bn), ceil(K/bk)] scales."""
    fmt = fmt or FP8Format()
    directory = Path(directory)
    fmt.not_converted = sorted(set(fmt.not_converted) | {f"model.language_model.layers.{i}" for i in mtp_layers})

    kept = set()

    def transform(name, tensor):
        if not converts(name, tensor, fmt):
            if tensor.dim() == 2 and name.endswith(".weight"):
                kept.add(name[:-len(".weight")])      # a projection left as it is: say so for readers
            return {name: tensor}
        q, s = quantize(tensor, fmt)
        return {name: q, name + SCALE_SUFFIX: s}
    save_weights(model, directory, transform=transform, stacked_experts=stacked_experts)
    fmt.not_converted = sorted(set(fmt.not_converted) | kept)
    path = directory / "config.json"
    config = json.loads(path.read_text()) if path.is_file() else model.config.to_hf_dict()
    config["quantization_config"] = fmt.to_config()
    path.write_text(json.dumps(config, indent=2))
