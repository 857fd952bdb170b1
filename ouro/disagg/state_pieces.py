"""What of a request's cache moves from a prefill worker to a decode worker, layer by layer.

For each decoder layer, in model order:
- a DSA layer: its latent rows of the prompt's tokens; a layer with its own indexer also its
  indexer keys and gate scores (rows) and the compressed key of every pool the tokens complete;
- a KDA layer: the request's conv window and recurrent state (only once the whole prompt is in:
  they are the state after its last token).

Rows of tokens [t0, t1) are sent as one contiguous block per piece. The receiver reads each block
straight into its own pages, one contiguous page segment at a time (`page_segments`), and the
states straight into its own slot: no staging copy. Pages on the two sides differ; token
positions and layer order are what both agree on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROW_PIECES = ("latent", "index_keys", "index_gates")      # per token
POOL_PIECE = "index_pooled"                                # per complete pool
STATE_PIECES = ("conv", "recurrent")                       # per request


@dataclass(frozen=True)
class LayerPieces:
    layer: int
    kind: str                  # "kda" or "dsa"
    cache_index: int           # the layer's index in its cache tensors
    indexer_index: int | None  # DSA with its own indexer: its index in the indexer tensors


class LayoutMismatch(RuntimeError):
    """The two workers keep cache rows differently: nothing of the request can be written."""


def cache_layout(cache) -> dict:
    """What both sides' caches must agree on for rows to move between them: the page size and, per
    cache tensor, its dtype and row width (JSON-able; travels in the room info)."""
    out = {"page_size": cache.page_size}
    for name in (*ROW_PIECES, POOL_PIECE, *STATE_PIECES):
        t = getattr(cache, name, None)
        if t is not None:
            out[name] = [[str(x.dtype).removeprefix("torch."), int(x.shape[-1])] for x in (t if isinstance(t, list) else [t])]
    return out


def check_layout(cache, room: dict) -> None:
    """Raise `LayoutMismatch` naming what differs where the decode worker's room says its cache keeps
    rows otherwise than `cache` (workers started with different --dtype or --kv-cache-dtype, or
    `--dtype auto` resolved differently on two machines). Without the check the first frame broke
    the connection and the decode side said only that it closed."""
    theirs = room.get("layout")
    if theirs is None:               # a decode worker that does not say: its frames are checked on arrival
        return
    mine = cache_layout(cache)
    diff = [f"{k}: {_said(mine.get(k))} here, {_said(theirs.get(k))} on the decode worker"
            for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]
    if diff:
        raise LayoutMismatch("this prefill worker's KV cache is laid out otherwise than the decode worker's ("
                             + "; ".join(diff) + "): start both with the same --dtype (not auto across machines), "
                             "--kv-cache-dtype and --page-size")


def _said(entry) -> str:
    """A layout entry as a reader wants it: "bfloat16 rows of 576" (per layer, where layers differ)."""
    if not isinstance(entry, list):
        return str(entry)
    return ", ".join(dict.fromkeys(f"{dtype} rows of {width}" for dtype, width in entry)) or "none"


def layer_pieces(config) -> list[LayerPieces]:
    """Every decoder layer's pieces, in model order."""
    out = []
    for i in range(config.num_hidden_layers):
        if i in config.kda_layers:
            out.append(LayerPieces(i, "kda", config.kda_layers.index(i), None))
        else:
            idx = config.indexer_layers.index(i) if i in config.indexer_layers else None
            out.append(LayerPieces(i, "dsa", config.dsa_layers.index(i), idx))
    return out


def pools_completed(t0: int, t1: int, kpool: int) -> range:
    """Pools whose last token lies in [t0, t1)."""
    return range(t0 // kpool, t1 // kpool)


def _items(cache, name: str, t0: int, t1: int) -> tuple[int, int, int]:
    """(first, stop, items per page) of piece `name` for tokens [t0, t1): rows or pools."""
    ps = cache.page_size
    if name in ROW_PIECES:
        return t0, t1, ps
    kpool = ps // cache.index_pooled.shape[2]
    pools = pools_completed(t0, t1, kpool)
    return pools.start, pools.stop, ps // kpool


def _pieces(cache, lp: LayerPieces, has_state: bool):
    """(name, cache tensor of this layer) in wire order."""
    if lp.kind == "kda":
        return [(n, getattr(cache, n)[lp.cache_index]) for n in STATE_PIECES] if has_state else []
    out = [("latent", cache.latent[lp.cache_index])]
    if lp.indexer_index is not None:
        j = lp.indexer_index
        out += [("index_keys", cache.index_keys[j]), ("index_gates", cache.index_gates[j]),
                (POOL_PIECE, cache.index_pooled[j])]
    return out


def _flat_rows(pages: list[int], per_page: int, first: int, stop: int) -> torch.Tensor:
    """Flat row ids (page * per_page + offset) of items [first, stop) laid over `pages`."""
    t = torch.arange(first, stop)
    return torch.tensor(pages, dtype=torch.long)[t // per_page] * per_page + t % per_page


def gather(cache, lp: LayerPieces, pages: list[int], slot: int, t0: int, t1: int, final: bool) -> list[torch.Tensor]:
    """The sender's blocks for one layer: rows of tokens [t0, t1), the pools they complete, and
    (when `final`: t1 is the prompt's end) the KDA states. Each block is contiguous."""
    out = []
    for name, t in _pieces(cache, lp, final):
        if name in STATE_PIECES:
            out.append(t[slot].contiguous())
            continue
        first, stop, per_page = _items(cache, name, t0, t1)
        out.append(t.reshape(-1, t.shape[-1])[_flat_rows(pages, per_page, first, stop)])
    return out


def page_segments(cache, lp: LayerPieces, pages: list[int], slot: int, t0: int, t1: int,
                  final: bool) -> list[list[torch.Tensor]]:
    """The receiver's destinations for `gather`'s blocks, in the same order: each block as the
    contiguous views of the receiver's own pages (or slot) it fills, front to back."""
    out = []
    for name, t in _pieces(cache, lp, final):
        if name in STATE_PIECES:
            out.append([t[slot]])
            continue
        first, stop, per_page = _items(cache, name, t0, t1)
        views, i = [], first
        while i < stop:
            page, off = pages[i // per_page], i % per_page
            n = min(per_page - off, stop - i)
            views.append(t[page, off:off + n])
            i += n
        out.append(views)
    return out


def block_bytes(blocks: list[torch.Tensor]) -> int:
    return sum(b.numel() * b.element_size() for b in blocks)
