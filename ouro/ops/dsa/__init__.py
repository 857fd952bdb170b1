"""DSA kernels: the lightning indexer (pool compression, top-k selection) and sparse latent MLA."""

from .indexer import index_select, index_select_naive, pool_keys, stable_topk_mask
from .sparse_mla import absorb_queries, absorb_weights, sparse_mla, sparse_mla_chunk, sparse_mla_naive

__all__ = ["absorb_queries", "absorb_weights", "index_select", "index_select_naive", "pool_keys", "sparse_mla",
           "sparse_mla_chunk", "sparse_mla_naive", "stable_topk_mask"]
