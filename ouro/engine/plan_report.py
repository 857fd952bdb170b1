"""`ouro plan`: what one sequence costs in cache memory at a given context, per model config."""

from __future__ import annotations

import torch

from ..config import KV_QUANTISED, ModelConfig
from ..layers.context import ModelCache


def sequence_bytes(config: ModelConfig, context: int, dtype=torch.bfloat16, page_size: int = 64,
                   kv_kinds: dict | None = None) -> dict:
    pages = -(-context // page_size)
    paged = pages * page_size * ModelCache.bytes_per_token(config, dtype, kv_kinds)
    state = ModelCache.bytes_per_slot(config)
    return {"context": context, "paged_bytes": paged, "state_bytes": state, "total_bytes": paged + state}


def format_plan(name: str, config: ModelConfig, contexts, dtype=torch.bfloat16) -> str:
    e = torch.empty(0, dtype=dtype).element_size()
    lines = [f"{name}: {len(config.dsa_layers)} DSA layers ({len(config.indexer_layers)} with an indexer), "
             f"{len(config.kda_layers)} KDA layers; cache dtype {str(dtype).replace('torch.', '')} ({e} B), "
             f"KDA state fp32",
             f"  per token (paged): {ModelCache.bytes_per_token(config, dtype):,} B; "
             f"per sequence KDA state slot: {ModelCache.bytes_per_slot(config) / 2**20:,.2f} MiB"]
    for c in contexts:
        r = sequence_bytes(config, c, dtype)
        lines.append(f"  context {c:>9,}: {r['total_bytes'] / 2**30:8.3f} GiB per sequence "
                     f"(paged {r['paged_bytes'] / 2**30:.3f} GiB + state {r['state_bytes'] / 2**30:.3f} GiB)")
    lines.append("  with a quantised KV cache (--kv-cache-dtype; DSA latents and indexer keys as rows with a float32 "
                 "scale per 128 values):")
    for kind in KV_QUANTISED:
        kinds = dict.fromkeys(config.dsa_layers, kind)
        per = ", ".join(f"{sequence_bytes(config, c, dtype, kv_kinds=kinds)['total_bytes'] / 2**30:.3f} GiB at {c:,}"
                        for c in contexts)
        lines.append(f"    {kind:<9} {ModelCache.bytes_per_token(config, dtype, kinds):,} B per token; per sequence {per}")
    return "\n".join(lines)
