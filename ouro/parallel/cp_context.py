"""The forward context of one rank of a context-parallel (CP) prefill.

Every rank of the CP group runs the same batch of sequences; of each sequence's new tokens it
holds one contiguous slice, in rank order. It is a `ForwardContext` for its own slices (positions
are global, so causal visibility and pool grouping follow the whole prompt) that answers the
layers' exchange hooks by talking to the other ranks:

- `write_rows` (DSA latents, indexer keys and gate scores): all-gather every rank's rows and store
  them all, so each rank's cache holds the whole prompt and its queries see every key before them;
- `completed_pools`: every pool the whole batch completes (a pool may straddle a cut), so each
  rank's pooled-key cache equals a single rank's;
- `conv_window`: the short conv's halo from the previous ranks (`cp_kda.conv_halo`);
- `delta_rule`: KCP (`cp_kda.kda_context_parallel`) in the configured precision;
- `dsa_begin` / `dsa_attend`: with LayerSplit (`layer_split`), a layer's rows cached before this
  forward come from the rank that owns the layer.

After the forward, the last rank's state slot holds the request's KDA state; every rank's pages
hold the whole prompt's DSA cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..layers.context import ForwardContext
from .cp_kda import all_gather, conv_halo, kda_context_parallel


def slice_bounds(n: int, world: int, cuts: list[int] | None = None) -> list[int]:
    """[0, c_1, ..., n]: where a sequence of n new tokens is cut among `world` ranks. Even cuts
    unless `cuts` (world - 1 ascending positions) are given; every slice gets at least one token."""
    if n < world:
        raise ValueError(f"a context-parallel prefill over {world} ranks needs at least {world} new tokens, got {n}")
    bounds = [0, *(cuts if cuts is not None else [n * r // world for r in range(1, world)]), n]
    if len(bounds) != world + 1 or any(b >= e for b, e in zip(bounds, bounds[1:])):
        raise ValueError(f"cuts {cuts} do not split {n} tokens into {world} non-empty slices")
    return bounds


@dataclass
class CPForwardContext(ForwardContext):
    group: object = None
    cp_rank: int = 0
    precision: str = "fp32"
    peers: list = field(default_factory=list)   # every rank's ForwardContext, in rank order
    split: object = None                         # a `layer_split.LayerSplit`: each layer's cached rows from its owner

    @classmethod
    def for_rank(cls, cache, bounds, start_pos, state_slots, page_table, group, cp_rank: int,
                 precision: str = "fp32", logits="last", split=None):
        """bounds[b]: `slice_bounds` of sequence b; start_pos[b]: its tokens already cached (the
        same on every rank, as is its state slot's content)."""
        def build(kind, r, lg):
            return kind.build(cache, [bd[r + 1] - bd[r] for bd in bounds], [s + bd[r] for s, bd in zip(start_pos, bounds)],
                              state_slots, page_table, logits=lg)
        world = len(bounds[0]) - 1
        ctx = build(cls, cp_rank, logits)
        ctx.group, ctx.cp_rank, ctx.precision, ctx.split = group, cp_rank, precision, split
        ctx.peers = [ctx if r == cp_rank else build(ForwardContext, r, "last") for r in range(world)]
        # a sequence is fresh when the request starts here, not where this rank's slice starts
        ctx.fresh = torch.tensor([s == 0 for s in start_pos], device=ctx.positions.device)
        ctx.__dict__["any_fresh"] = any(s == 0 for s in start_pos)
        return ctx

    # every rank runs the chunked forms, whatever its slice length
    split_decode = None
    is_decode = False
    rows_as_queries = False

    def write_rows(self, flat, values):
        values = values.to(flat.dtype)
        width = max(p.slot_mapping.numel() for p in self.peers)
        buf = values.new_zeros(width, *values.shape[1:])
        buf[: values.shape[0]] = values
        got = all_gather(buf, self.group)
        flat[self._all_rows] = torch.cat([g[: p.slot_mapping.numel()] for g, p in zip(got, self.peers)])

    @property
    def _all_rows(self):
        if "_rows" not in self.__dict__:
            self.__dict__["_rows"] = torch.cat([p.slot_mapping for p in self.peers])
        return self.__dict__["_rows"]

    def completed_pools(self, kpool: int):
        found = [f for f in (ForwardContext.completed_pools(p, kpool) for p in self.peers) if f is not None]
        if not found:
            return None
        return torch.cat([f[0] for f in found]), torch.cat([f[1] for f in found]), None

    def conv_window(self, x, window, lengths):
        return conv_halo(x, window, lengths, self.group)

    def dsa_begin(self, layer) -> None:
        if self.split is not None:
            self.split.begin(layer, self)

    def dsa_attend(self, layer) -> None:
        if self.split is not None:
            self.split.attend(layer, self)

    def delta_rule(self, q, k, v, g, beta, state, chunk_size: int):
        return kda_context_parallel(q, k, v, g, beta, state, self.group, chunk_size, self.precision)
