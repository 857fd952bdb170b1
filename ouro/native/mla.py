"""DSA decode as native ops (`mla.cpp`): the indexer's pool scores and top-k, and the sparse absorbed
MLA over the paged latent cache, both reading cache rows in place through the page table."""

from __future__ import annotations

import torch

from .kernels import fused_off, load, ops, register_fakes, usable

FAMILY = "mla"
KINDS = ("int8", "fp8_e4m3")


def can(*tensors) -> bool:
    return usable(FAMILY, *tensors)


def cache_storage(rows):
    """A cache layer viewed flat (a float32 or bfloat16 tensor [R, r], or the cache's `QuantisedRows`)
    -> (the storage the op reads, its kind: '' or a quantised kind); None where the op cannot read it."""
    if isinstance(rows, torch.Tensor):
        readable = rows.dtype in (torch.float32, torch.bfloat16) and rows.device.type == "cpu"
        return (rows, "") if readable else None
    flat, kind = getattr(rows, "flat", None), getattr(rows, "kind", None)
    if isinstance(flat, torch.Tensor) and flat.device.type == "cpu" and kind in KINDS:
        return flat, kind
    return None


def sparse_mla_decode(q_lat, storage, kind: str, group: int, tokens, page_table, seq, page_size: int):
    """q_lat [n, H, r] (absorbed through W_uk and scaled); storage/kind from `cache_storage` (quantised
    rows in groups of `group` values); tokens [n, W] positions of sequence seq[n] (a page_table row), -1
    unused. Returns the attended latent [n, H, r] (NaN for a row that selects nothing)."""
    return ops(FAMILY).sparse_mla_decode(q_lat, storage, kind, group, tokens, page_table, seq, page_size)


def index_select_decode(q, weights, pooled, page_table, seq, positions, page_size: int, select_k: int, kpool: int,
                        scale: float, width: int):
    """`ops.dsa.index_select` for decode queries, the pool keys read from the cache's pool rows
    (`pooled` [pages * page_size / kpool, d]) through page_table[seq]. Returns [n, width] int64."""
    return ops(FAMILY).index_select_decode(q, weights, pooled, page_table, seq, positions, page_size, select_k,
                                           kpool, scale, width)


def pool_keys_write(pooled, keys, kind: str, group: int, gates, ape, page_table, seq, ends, complete,
                    page_size: int) -> None:
    """`ops.dsa.pool_keys` of the pools ending at `ends` [n] of sequences `seq` [n], written in place to
    their rows of `pooled` [pool rows, d] (float32). keys/kind from `cache_storage` (quantised rows in
    groups of `group`), gates the cache's gate rows [rows, d], ape [kpool, d]. With `complete` [n] (a
    graph's every row), only the rows it marks are computed and written."""
    ops(FAMILY).pool_keys_write(pooled, keys, kind, group, gates, ape.float(), page_table, seq, ends, complete,
                                page_size)


def write_rows(dst, rows, src) -> None:
    """dst[rows] = src for a 2-D cache layer, in place. Inside a compiled graph's trace it runs as the
    native op (the graph writes the rows where they are, not through a copy of the layer); elsewhere
    as the indexed store it is."""
    if torch.compiler.is_compiling() and dst.device.type == "cpu" and not fused_off() and load(FAMILY):
        ops(FAMILY).write_rows(dst, rows, src.to(dst.dtype))
    else:
        dst[rows] = src.to(dst.dtype)


@register_fakes(FAMILY)
def _fakes():
    torch.library.register_fake("ouro_native::write_rows")(lambda dst, rows, src: None)
    torch.library.register_fake("ouro_native::pool_keys_write")(lambda pooled, *rest: None)
    torch.library.register_fake("ouro_native::sparse_mla_decode")(
        lambda q_lat, *rest: q_lat.new_empty(q_lat.shape))
    torch.library.register_fake("ouro_native::index_select_decode")(
        lambda q, weights, pooled, page_table, seq, positions, page_size, select_k, kpool, scale, width:
        q.new_empty((q.shape[0], width), dtype=torch.long))
