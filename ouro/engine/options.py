"""Engine options checked against each other, the model's config and the machine, before any
weights load. `check_engine_options` runs once per engine, first thing: the server and `LLM` call it
before they load weights; the engine they then build takes the config as checked. An `LLMEngine`
built directly (`LLMEngine(model, ...)`) checks it itself."""

from __future__ import annotations

from ..config import EngineConfig
from . import tp_workers


def check_engine_options(config: EngineConfig, mc) -> None:
    """Engine options against each other, the model's config and the machine (no weights needed)."""
    config.validate()
    config.check_device()
    tp_workers.check_options(config, mc)
    if config.speculative_algorithm and config.context_parallel_size > 1:
        raise ValueError("speculative decoding does not combine with context parallelism yet; drop one of them")
    if config.speculative_algorithm and not mc.has_mtp:
        raise ValueError("speculative decoding with NEXTN needs a checkpoint with an MTP layer "
                         "(num_nextn_predict_layers >= 1); this one has none")
    if config.deterministic_inference and config.compile:
        raise ValueError("--enable-deterministic-inference runs torch's kernels eagerly (a compiled graph would "
                         "bypass the batch-invariant ones); drop --compile")
    if config.kv_kinds(mc) and config.compile:
        raise ValueError("a quantised KV cache (--kv-cache-dtype / --kv-cache-layer-dtype) does not combine with "
                         "--compile yet; drop one of them")
    if config.page_size % mc.index_kpool:
        raise ValueError(f"page_size must be a multiple of the model's index_kpool ({mc.index_kpool}), "
                         f"got {config.page_size}")
