"""Frozen configuration objects: `ModelConfig` (the text part of a `glm5_next` config.json,
`model.py`) and `EngineConfig` (how the engine runs it, `engine.py`)."""

from .engine import EngineConfig, parse_layer_kv, speculative_args, split_patterns, tp_args
from .model import KV_DTYPES, KV_GROUP, KV_QUANTISED, CheckpointError, ModelConfig, quantised_row_bytes

__all__ = ["KV_DTYPES", "KV_GROUP", "KV_QUANTISED", "CheckpointError", "EngineConfig", "ModelConfig",
           "parse_layer_kv", "quantised_row_bytes", "speculative_args", "split_patterns", "tp_args"]
