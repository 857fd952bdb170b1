"""Engine options checked against each other, the model's config and the machine, before any
weights load (`check_engine_options`: the server and `LLM` call it first, then the engine they build)."""

from __future__ import annotations

from ..config import EngineConfig
from . import tp_workers


def check_engine_options(config: EngineConfig, mc, enable_prefix_caching: bool, checkpoint_interval: int) -> None:
    """Engine options against each other, the model's config and the machine (no weights needed)."""
    config.validate()
    config.check_device()
    if isinstance(checkpoint_interval, bool) or not isinstance(checkpoint_interval, int) or checkpoint_interval < 1:
        raise ValueError(f"prefix checkpoint_interval must be an integer >= 1 (pages), got {checkpoint_interval!r}")
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
    if enable_prefix_caching and checkpoint_interval * config.page_size > config.max_num_batched_tokens:
        raise ValueError(f"the prefix-cache checkpoint interval ({checkpoint_interval} pages x page_size "
                         f"{config.page_size}) must fit in max_num_batched_tokens ({config.max_num_batched_tokens}), "
                         "or prefill could never reach a checkpoint")
