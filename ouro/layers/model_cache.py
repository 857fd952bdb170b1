"""Where the per-sequence caches live: `ModelCache` (KDA state slots, paged DSA rows) and
`QuantisedRows`, a quantised cache layer read and written as float rows. Layers read and write it
in place through `ForwardContext.cache` (`context.py`)."""

from __future__ import annotations

import os

import torch

from ..config import ModelConfig, quantised_row_bytes
from ..native.mla import write_rows
from ..ops.quant.kv_rows import decode_rows, encode_rows


class ModelCache:
    """Storage for every sequence's model state.

    - KDA layers: one state slot per sequence (conv window [3*linear_dim, K-1] and fp32 recurrent
      state [H, dk, dv] for every KDA layer); size does not grow with context.
    - DSA layers: paged latent KV [n_pages, page_size, kv_lora_rank] per DSA layer, and for layers
      with their own indexer the indexer keys and pool-gate scores [n_pages, page_size, d] plus
      the fp32 compressed key of each complete pool [n_pages, page_size / kpool, d].

    Allocated uninitialised (`torch.empty`) and never filled: memory the OS has not handed out yet is
    touched, and becomes resident, only when a request writes its rows or state, so resident memory
    follows use rather than the budget. Nothing may read what was never written: a fresh sequence's
    state slot reads as zero (`ForwardContext.fresh`), cache rows are read only at positions written
    (the NaN-poisoned tests check both). `OURO_POISON_CACHE=1` fills every new cache with NaN
    (`poison`), a debugging switch that touches it all.
    """

    def __init__(self, config: ModelConfig, n_slots: int, n_pages: int, page_size: int,
                 dtype=torch.float32, device="cpu", kv_kinds: dict | None = None, keep_dsa=None):
        """kv_kinds {DSA layer id: "fp8_e4m3" | "int8"}: those layers keep their latent rows and
        indexer keys as quantised rows (`ops.quant.kv_rows`: bytes with their scales inside).
        keep_dsa: DSA cache indices whose rows this cache stores (LayerSplit, `parallel.layer_split`);
        every other DSA layer's storage is one shared scratch layer. None: all of them."""
        if page_size % config.index_kpool:
            raise ValueError(f"page_size {page_size} must be a multiple of index_kpool {config.index_kpool}")
        c = config
        self.config = config        # the layout's config (the model's, or with the MTP draft layer)
        self.page_size = page_size
        self.n_slots, self.n_pages = n_slots, n_pages
        kw = dict(device=device)
        self.conv = torch.empty(len(c.kda_layers), n_slots, 3 * c.linear_dim, c.linear_conv_kernel_dim - 1,
                                dtype=torch.float32, **kw)
        self.recurrent = torch.empty(len(c.kda_layers), n_slots, c.linear_num_heads, c.linear_head_dim,
                                     c.linear_head_dim, dtype=torch.float32, **kw)
        self.device = torch.device(device)
        self.kv_lora_rank, self.index_head_dim = c.kv_lora_rank, c.index_head_dim
        kinds = kv_kinds or {}
        # per DSA layer (cache index) and per indexer layer: None (rows in `dtype`) or the quantised kind
        self.latent_kinds = [kinds.get(layer) for layer in c.dsa_layers]
        self.key_kinds = [kinds.get(layer) for layer in c.indexer_layers]
        self.latent = _rows_storage(self.latent_kinds, n_pages, page_size, c.kv_lora_rank, dtype, device)
        self.index_keys = _rows_storage(self.key_kinds, n_pages, page_size, c.index_head_dim, dtype, device)
        self.index_gates = torch.empty(len(c.indexer_layers), n_pages, page_size, c.index_head_dim, dtype=dtype, **kw)
        # compressed key of every complete pool, written once when the pool's last token arrives
        self.index_pooled = torch.empty(len(c.indexer_layers), n_pages, page_size // c.index_kpool,
                                        c.index_head_dim, dtype=torch.float32, **kw)
        if keep_dsa is not None:
            from .split_storage import keep_only
            keep_only(self, set(keep_dsa))
        if poison_from_env():
            self.poison()

    def dsa_bytes(self) -> int:
        """Bytes the DSA rows occupy, each storage counted once (a split cache's scratch once)."""
        seen, total = set(), 0
        for store in (self.latent, self.index_keys, self.index_gates, self.index_pooled):
            for t in (store if isinstance(store, list) else [store]):
                if t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    total += t.numel() * t.element_size()
        return total

    @staticmethod
    def bytes_per_token(config: ModelConfig, dtype=torch.float32, kv_kinds: dict | None = None) -> int:
        """Paged bytes one token of context costs across all DSA layers."""
        return config.cache_bytes_per_token(dtype, kv_kinds)

    def latent_rows(self, li: int):
        """DSA layer `li`'s latent cache viewed flat [rows, r]: a tensor, or `QuantisedRows` that read as one."""
        return _flat(self.latent[li], self.latent_kinds[li], self.kv_lora_rank)

    def key_rows(self, ci: int):
        """Indexer layer `ci`'s key cache viewed flat [rows, d]."""
        return _flat(self.index_keys[ci], self.key_kinds[ci], self.index_head_dim)

    @staticmethod
    def bytes_per_slot(config: ModelConfig) -> int:
        """Bytes of one KDA state slot (all KDA layers), independent of context length."""
        return config.state_bytes_per_slot

    def poison(self):
        """Fill everything with NaN so a read of never-written memory shows up in outputs (quantised
        rows: bytes 0xFF, a NaN scale)."""
        for t in (self.conv, self.recurrent):
            t.fill_(float("nan"))
        for store in (self.latent, self.index_keys, self.index_gates, self.index_pooled):
            for t in (store if isinstance(store, list) else [store]):
                t.fill_(255) if t.dtype == torch.uint8 else t.fill_(float("nan"))


POISON_ENV = "OURO_POISON_CACHE"


def poison_from_env() -> bool:
    """`OURO_POISON_CACHE=1`: every `ModelCache` starts NaN (debugging reads of never-written memory)."""
    return os.environ.get(POISON_ENV, "").strip() not in ("", "0")


def _rows_storage(kinds: list, n_pages: int, page_size: int, d: int, dtype, device):
    """One tensor [layers, pages, page_size, width] when every layer stores rows the same way (all
    in `dtype`, or all quantised: uint8 rows of `quantised_row_bytes(d)`); a list per layer when mixed.
    Uninitialised: pages become resident as rows are written."""
    def one(kind, n=None):
        shape = (n,) if n is not None else ()
        if kind is None:
            return torch.empty(*shape, n_pages, page_size, d, dtype=dtype, device=device)
        return torch.empty(*shape, n_pages, page_size, quantised_row_bytes(d), dtype=torch.uint8, device=device)
    if len(set(k is None for k in kinds)) <= 1:
        return one(kinds[0] if kinds else None, len(kinds))
    return [one(k) for k in kinds]


class QuantisedRows:
    """A quantised cache layer viewed flat: indexing reads rows back as float32 [.., d]; assigning
    float rows quantises them (each row with its own scales). What the layers and `sparse_mla`
    index in place of a float tensor."""

    def __init__(self, flat: torch.Tensor, kind: str, d: int):
        self.flat, self.kind, self.d = flat, kind, d
        self.shape = (flat.shape[0], d)
        self.device, self.dtype = flat.device, torch.float32

    def __getitem__(self, idx):
        rows = self.flat[idx]
        return decode_rows(rows.reshape(-1, rows.shape[-1]), self.d, self.kind).view(*rows.shape[:-1], self.d)

    def __setitem__(self, idx, values):
        encoded = encode_rows(values.reshape(-1, self.d), self.kind).view(*values.shape[:-1], -1)
        if isinstance(idx, torch.Tensor) and idx.dim() == 1 and encoded.dim() == 2:
            write_rows(self.flat, idx, encoded)
        else:
            self.flat[idx] = encoded

    def to(self, dtype):
        return decode_rows(self.flat, self.d, self.kind).to(dtype)


def _flat(storage: torch.Tensor, kind, d: int):
    return storage.view(-1, d) if kind is None else QuantisedRows(storage.view(-1, storage.shape[-1]), kind, d)
