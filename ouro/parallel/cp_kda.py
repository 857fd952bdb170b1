"""Context-parallel KDA prefill (KCP) across ranks.

Each rank of the CP group holds a contiguous slice of the prompt, in rank order. It computes its
slice's summary (`ouro.ops.kda.cp.slice_summary`: the state it reaches from zero, and the
transition mapping any incoming state to its outgoing one). The ranks all-gather the summaries,
each chains its predecessors' from the request's initial state, and runs its own slice from the
true state it gets. The last rank's final state is the request's state for decode.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..measure.spans import span
from ..ops.conv1d import last_columns, last_inputs
from ..ops.kda.chunk import kda_chunk
from ..ops.kda.cp import _mm, chain_states, slice_summary, start_state


@span("cp exchange", cat="transfer")
def all_gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def kda_context_parallel(q, k, v, g, beta, initial_state, group, chunk_size: int = 16, precision: str = "fp32"):
    """This rank's slice [B, T_r, H, ...] of the prompt (the same batch on every rank; every rank
    passes the request's initial state, or None). Returns (o of this slice, the state after it):
    the last rank's is the request's final state."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    S0 = start_state(k, v, initial_state)
    if rank < world - 1:
        P, Z = slice_summary(q, k, v, g, beta, chunk_size, precision)
    else:   # no rank follows the last: it only takes part in the exchange
        P, Z = S0.new_zeros(*S0.shape[:-1], S0.shape[-2]), torch.zeros_like(S0)
    Ps, Zs = all_gather(P, group), all_gather(Z, group)
    state = chain_states(list(zip(Ps[:rank], Zs[:rank])), S0, precision)[-1]
    return kda_chunk(q, k, v, g, beta, state, chunk_size, mm=_mm(precision))


def conv_halo(x, conv_state, lengths, group):
    """The short conv's window entering this rank's slice: the last K-1 inputs before it.
    x: this rank's inputs [B, C, T_r], right-padded to the real lengths [B]; conv_state: the
    request's window before the prompt [B, C, K-1] (zeros for a fresh one), the same on every
    rank. Ranks all-gather their last min(length, K-1) inputs; folding the predecessors' in rank
    order gives the window, so a slice shorter than K-1 (even an empty one) passes on the ones
    before it and any cut works."""
    rank = dist.get_rank(group)
    K1 = conv_state.shape[-1]
    window = conv_state.to(torch.promote_types(x.dtype, conv_state.dtype))
    if K1 == 0:
        return window
    lengths = lengths.to(torch.long)
    m = lengths.clamp(max=K1)
    # this slice's last m inputs, left-aligned in K-1 columns (the rest is padding)
    padded = torch.cat([x.to(window.dtype), window.new_zeros(*x.shape[:2], K1)], dim=-1)
    lead = last_columns(padded, lengths - m, K1)
    leads, counts = all_gather(lead, group), all_gather(m, group)
    for r in range(rank):
        window = last_inputs(window, leads[r], counts[r])
    return window
