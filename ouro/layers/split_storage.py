"""A `ModelCache` that stores only some DSA layers' rows (LayerSplit, `parallel.layer_split`): the
kept layers keep their own storage; one scratch layer, NaN until written, stands for every other
DSA layer (its indexer's keys, gates and pooled keys too), so a rank holds its block plus one layer."""

from __future__ import annotations

import torch


def keep_only(cache, keep: set) -> None:
    c = cache.config
    if any(k is not None for k in cache.latent_kinds + cache.key_kinds):
        raise ValueError("a layer-split cache keeps DSA rows in the model dtype: drop --kv-cache-dtype")
    kept_idx = {ci for ci, layer in enumerate(c.indexer_layers) if c.dsa_layers.index(layer) in keep}

    def split(store, kept):     # the kept layers uninitialised (touched as written), as `ModelCache` allocates
        scratch = torch.full_like(store[0], float("nan"))
        return [torch.empty_like(store[i]) if i in kept else scratch for i in range(store.shape[0])]
    cache.latent = split(cache.latent, keep)
    cache.index_keys = split(cache.index_keys, kept_idx)
    cache.index_gates = split(cache.index_gates, kept_idx)
    cache.index_pooled = split(cache.index_pooled, kept_idx)
