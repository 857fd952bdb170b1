"""One context-parallel forward of a built model: this rank's slices of a batch of prompts."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .cp_context import CPForwardContext, slice_bounds


def cp_forward(model, cache, group, token_ids: list[list[int]], start_pos: list[int], state_slots: list[int],
               page_table, precision: str = "fp32", cuts: list[list[int]] | None = None, logits="last", split=None):
    """Run this rank's slice of each sequence's new tokens `token_ids[b]` (the same batch on every
    rank; sequence b already has start_pos[b] tokens in `cache`, pages `page_table[b]`, KDA
    state in slot `state_slots[b]`). Returns (logits of the rows `logits` names among this rank's
    tokens, the slice bounds of every sequence). On return every rank's cache holds the prompts'
    DSA rows and the last rank's slots hold the requests' KDA states. `split`: this rank's
    `layer_split.LayerSplit` (its cache keeps only its own layers' rows)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    bounds = [slice_bounds(len(t), world, None if cuts is None else cuts[b]) for b, t in enumerate(token_ids)]
    ctx = CPForwardContext.for_rank(cache, bounds, start_pos, state_slots, page_table, group, rank, precision, logits,
                                    split)
    ids = [t for tok, bd in zip(token_ids, bounds) for t in tok[bd[rank]:bd[rank + 1]]]
    return model(torch.tensor(ids, device=cache.device), ctx), bounds
