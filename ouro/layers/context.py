"""What one forward pass needs to know about its batch, and where the per-sequence caches live.

The engine (or a simple runner) builds a `ForwardContext` per step; layers read positions, page
tables and state-slot indices from it and read/write `ModelCache` (`model_cache.py`, named here
too) in place. Layers never import the engine: this file is the whole contract between them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ..native.mla import write_rows
from ..ops.kda import kda_chunk
from .model_cache import ModelCache, QuantisedRows  # noqa: F401 - the contract's names, read from here

SHORT_ROWS = 8      # new tokens per sequence up to which DSA layers run rows as independent queries


@dataclass
class ForwardContext:
    """Batch metadata for one forward over a flat batch of B sequences' new tokens."""
    cache: ModelCache
    query_lens: list[int]        # new tokens per sequence
    start_pos: list[int]         # tokens each sequence already has in the cache
    cu_seqlens: torch.Tensor     # [B+1]
    positions: torch.Tensor      # [T] absolute position of each new token
    seq_index: torch.Tensor      # [T] which sequence each token belongs to
    local_index: torch.Tensor    # [T] index of the token among its sequence's new tokens
    state_slots: torch.Tensor    # [B] KDA state slot of each sequence
    fresh: torch.Tensor          # [B] bool: sequence starts here (its KDA state must read as zero)
    page_table: torch.Tensor     # [B, max_pages] cache page ids
    slot_mapping: torch.Tensor   # [T] flat cache row (page * page_size + offset) of each new token
    logits_index: torch.Tensor | None  # rows whose logits are wanted (None: all)
    state_slots_list: list[int]  # host copy of state_slots
    keep_hidden: bool = False    # the model leaves every row's final hidden state in `hidden` (drafting)
    hidden: torch.Tensor | None = None
    # speculative rows: batch index -> what their KDA layers keep for replay instead of committing
    # their state (`engine.speculative`); None: every row commits as usual
    replay: dict | None = None
    # image rows: (flat row indices, their embeddings) that replace those tokens' embeddings
    embeds: tuple | None = None

    @classmethod
    def build(cls, cache: ModelCache, query_lens, start_pos, state_slots, page_table, logits: str = "last"):
        dev = cache.device
        B = len(query_lens)
        ql = torch.tensor(query_lens, dtype=torch.long)
        cu = torch.zeros(B + 1, dtype=torch.long)
        cu[1:] = ql.cumsum(0)
        seq_index = torch.repeat_interleave(torch.arange(B), ql)
        local = torch.arange(int(cu[-1])) - cu[:-1][seq_index]
        positions = torch.tensor(start_pos, dtype=torch.long)[seq_index] + local
        pt = torch.as_tensor(page_table, dtype=torch.long).reshape(B, -1)
        ps = cache.page_size
        slot_mapping = pt[seq_index, positions // ps] * ps + positions % ps
        idx = {"all": None, "last": cu[1:] - 1}[logits] if isinstance(logits, str) else torch.as_tensor(logits)
        to = lambda t: None if t is None else t.to(dev)
        return cls(cache=cache, query_lens=list(query_lens), start_pos=list(start_pos), cu_seqlens=to(cu),
                   positions=to(positions), seq_index=to(seq_index), local_index=to(local),
                   state_slots=to(torch.as_tensor(state_slots, dtype=torch.long)),
                   fresh=to(torch.tensor([s == 0 for s in start_pos])), page_table=to(pt),
                   slot_mapping=to(slot_mapping), logits_index=to(idx),
                   state_slots_list=[int(s) for s in state_slots])

    # Facts about the batch that every layer asks for: derived once per forward, not per layer.
    @cached_property
    def split_decode(self):
        """For a batch mixing decode rows (one new token) with prefill chunks: the two halves as
        (sub-context, flat token rows) pairs, so each can take its own path. None if not mixed."""
        dec = [b for b, n in enumerate(self.query_lens) if n == 1]
        if not dec or len(dec) == len(self.query_lens):
            return None
        return [self.subset(part) for part in (dec, [b for b, n in enumerate(self.query_lens) if n != 1])]

    def subset(self, seqs: list[int]):
        """The context of some of the batch's sequences, and the flat rows of their tokens."""
        rows = torch.cat([torch.arange(int(self.cu_seqlens[b]), int(self.cu_seqlens[b + 1])) for b in seqs])
        sub = ForwardContext.build(self.cache, [self.query_lens[b] for b in seqs], [self.start_pos[b] for b in seqs],
                                   [self.state_slots_list[b] for b in seqs], self.page_table[seqs].cpu(), "all")
        if self.replay:
            sub.replay = {i: self.replay[b] for i, b in enumerate(seqs) if b in self.replay} or None
        return sub, rows.to(self.positions.device)

    @cached_property
    def slot_range(self) -> slice | None:
        """The state slots as a slice when they are consecutive in batch order (then KDA layers
        update the cache in place instead of gathering and scattering states)."""
        first = int(self.state_slots_list[0])
        if self.state_slots_list == list(range(first, first + len(self.state_slots_list))):
            return slice(first, first + len(self.state_slots_list))
        return None

    @cached_property
    def any_fresh(self) -> bool:
        return any(s == 0 for s in self.start_pos)

    @cached_property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.query_lens)

    @cached_property
    def rows_as_queries(self) -> bool:
        """Every sequence adds at most SHORT_ROWS tokens to a context it already has (decode rows,
        speculative verifications, a draft layer's rows): the DSA layers then treat each new token
        as its own query over its sequence's cache, in one batched pass, instead of looping over
        sequences as a prefill does."""
        return all(0 < n <= SHORT_ROWS for n in self.query_lens) and all(s > 0 for s in self.start_pos)

    @cached_property
    def query_lens_tensor(self) -> torch.Tensor:
        return torch.tensor(self.query_lens, device=self.positions.device)

    def pool_ends(self, kpool: int) -> torch.Tensor | None:
        """Flat rows of the tokens that complete a pool of `kpool` (position + 1 divisible by it),
        from the host-side lengths: no device-to-host read inside a layer. None if there are none."""
        cache = self.__dict__.setdefault("_pool_ends", {})
        if kpool not in cache:
            rows, offset = [], 0
            for start, n in zip(self.start_pos, self.query_lens):
                first = -(-(start + 1) // kpool) * kpool - 1      # first position p >= start with (p+1) % kpool == 0
                rows += [offset + p - start for p in range(first, start + n, kpool)]
                offset += n
            cache[kpool] = torch.tensor(rows, dtype=torch.long, device=self.positions.device) if rows else None
        return cache[kpool]

    def completed_pools(self, kpool: int):
        """The pools of `kpool` that this batch's tokens complete, as (sequence [n], position of
        the pool's last token [n], mask): every one named writes its pool (mask None). None if
        there are none. `GraphContext` answers with every row and a mask."""
        ends = self.pool_ends(kpool)
        return None if ends is None else (self.seq_index[ends], self.positions[ends], None)

    # How the batch's tokens meet the rest of their sequences: through the cache, on one rank.
    # A context-parallel context (`ouro.parallel.cp_context`) exchanges with the other ranks here.
    def write_rows(self, flat: torch.Tensor, values: torch.Tensor) -> None:
        """Store the new tokens' rows `values` [T, d] into a paged cache viewed flat [rows, d]."""
        if isinstance(flat, torch.Tensor):
            write_rows(flat, self.slot_mapping, values)
        else:                       # the cache's QuantisedRows encodes them
            flat[self.slot_mapping] = values.to(flat.dtype)

    def conv_window(self, x, window, lengths):
        """The short conv's window entering the new tokens x [B, C, T]: the cached one."""
        return window

    def dsa_begin(self, layer) -> None:
        """A DSA layer (`layers.dsa.DSAttention`) starts: its cached rows must be readable by the
        time its indexer and then its attention read them. Here they are."""

    def dsa_attend(self, layer) -> None:
        """The layer's attention is about to read its latent rows (the indexer has run)."""

    def delta_rule(self, q, k, v, g, beta, state, chunk_size: int):
        """The chunked gated delta rule over the new tokens from `state`: (o, final state)."""
        return kda_chunk(q, k, v, g, beta, state, chunk_size)

    @property
    def recurrence_is_local(self) -> bool:
        """The KDA conv window and delta rule of these tokens need nothing beyond this context (a
        context that exchanges them with other ranks overrides `conv_window` / `delta_rule`): a
        layer may then run each sequence's tokens through one fused op."""
        cls = type(self)
        return cls.delta_rule is ForwardContext.delta_rule and cls.conv_window is ForwardContext.conv_window

    def decode_pools(self, kpool: int) -> int:
        """Pools a decode batch's indexer reads per row: the longest context's complete pools."""
        return max(self.context_len(b) for b in range(len(self.query_lens))) // kpool

    def context_len(self, b: int) -> int:
        return self.start_pos[b] + self.query_lens[b]

    def rows(self, b: int) -> slice:
        return slice(int(self.cu_seqlens[b]), int(self.cu_seqlens[b + 1]))

    def pad(self, x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """[T, ...] flat -> [B, max_len, ...] right-padded with `fill`."""
        if self.is_decode:
            return x.unsqueeze(1)
        out = x.new_full((len(self.query_lens), max(self.query_lens), *x.shape[1:]), fill)
        out[self.seq_index, self.local_index] = x
        return out

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_decode:
            return x.squeeze(1)
        return x[self.seq_index, self.local_index]


class GraphContext:
    """`ForwardContext`'s decode-only counterpart for a compiled decode step (`ouro.engine.
    decode_graph`): tensors and constants only, no host-side lists, so a graph traced once holds
    for every step of its shape. The batch is padded to a bucket: padding rows point at a scratch
    state slot and a scratch page, where their writes land and no sequence reads. Every decision
    ForwardContext takes from host-side lengths is made on tensors here:
    - a fresh row's state is masked on every step (`any_fresh` is always True);
    - states are gathered and scattered by slot (no in-place slot range);
    - the indexer compresses every row's current pool and writes only completed ones to their
      place, the rest to the scratch page (`completed_pools`);
    - the indexer reads `page_table`'s whole width of pools, masked per row by position."""
    is_decode = True
    rows_as_queries = True
    embeds = None            # a decode step's tokens are text
    split_decode = None
    slot_range = None
    any_fresh = True
    logits_index = None
    replay = None            # a compiled decode step carries no speculative rows
    keep_hidden = False

    def __init__(self, cache: ModelCache, positions, slot_mapping, state_slots, fresh, page_table, scratch_page: int):
        self.cache, self.positions, self.slot_mapping = cache, positions, slot_mapping
        self.state_slots, self.fresh, self.page_table = state_slots, fresh, page_table
        self.scratch_page = scratch_page
        self.seq_index = torch.arange(positions.shape[0], device=positions.device)
        self.query_lens_tensor = torch.ones_like(self.seq_index)

    def completed_pools(self, kpool: int):
        """(every row, its position, which of them completes its pool now)."""
        return self.seq_index, self.positions, (self.positions + 1) % kpool == 0

    write_rows, conv_window = ForwardContext.write_rows, ForwardContext.conv_window
    dsa_begin, dsa_attend = ForwardContext.dsa_begin, ForwardContext.dsa_attend

    def scratch_pool_row(self, kpool: int) -> int:
        return self.scratch_page * (self.cache.page_size // kpool)

    def decode_pools(self, kpool: int) -> int:
        return self.page_table.shape[1] * self.cache.page_size // kpool

    @staticmethod
    def pad(x):
        return x.unsqueeze(1)

    @staticmethod
    def unpad(x):
        return x.squeeze(1)
