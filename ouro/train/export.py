"""Write a trained model as a checkpoint directory ouro and transformers both load: the
`save_pretrained` layout (MTP block at `model.language_model.layers.N`, embeddings and head shared
with the trunk, so not repeated), ouro's config.json with `num_nextn_predict_layers: 1`, the
tokenizer with the GLM chat template, and the generation config."""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
from pathlib import Path

import torch

from ..config import ModelConfig
from ..models.presets import PRESET_FORMAT, generation_config
from ..models.tokenizer_factory import write_tokenizer_files
from .hf_model import VISION

WEIGHTS = "model.safetensors"


def export_checkpoint(model, config: ModelConfig, tokenizer, directory, dtype=torch.bfloat16,
                      info: dict | None = None, preset: str = "tiny-py") -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        m = copy.deepcopy(model).to(dtype)
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
        m.save_pretrained(tmp, safe_serialization=True)
        shutil.move(str(Path(tmp) / WEIGHTS), str(directory / WEIGHTS))   # one file: a few MB
    (directory / WEIGHTS).chmod(0o644)      # the temporary directory's files are private (0600)
    hf = config.to_hf_dict(dict(VISION, out_hidden_size=config.hidden_size))
    hf["text_config"]["num_nextn_predict_layers"] = 1
    hf["dtype"] = str(dtype).removeprefix("torch.")
    (directory / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    (directory / "generation_config.json").write_text(json.dumps(generation_config(config), indent=2) + "\n")
    write_tokenizer_files(directory, config.vocab_size, config.max_position_embeddings, tokenizer=tokenizer)
    marker = {"preset": preset, "random_init": False, "format": PRESET_FORMAT, "trained": info or {}}
    (directory / "ouro_preset.json").write_text(json.dumps(marker, indent=2) + "\n")
    return directory
