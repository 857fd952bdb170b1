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

from ..ops.kda.chunk import kda_chunk
from ..ops.kda.cp import _mm, chain_states, slice_summary, start_state


def all_gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def kda_context_parallel(q, k, v, g, beta, initial_state, group, chunk_size: int = 16, precision: str = "fp32"):
    """This rank's slice [B, T_r, H, ...] of the prompt (the same batch on every rank; every rank
    passes the request's initial state, or None). Returns (o of this slice, the state after it):
    the last rank's is the request's final state."""
    rank = dist.get_rank(group)
    S0 = start_state(k, v, initial_state)
    P, Z = slice_summary(q, k, v, g, beta, chunk_size, precision)
    Ps, Zs = all_gather(P, group), all_gather(Z, group)
    state = chain_states(list(zip(Ps[:rank], Zs[:rank])), S0, precision)[-1]
    return kda_chunk(q, k, v, g, beta, state, chunk_size, mm=_mm(precision))


def conv_halo(x, conv_state, group):
    """The short conv's window entering this rank's slice: the last K-1 inputs before it.
    x: this rank's inputs [B, C, T_r]; conv_state: the request's window before the prompt
    [B, C, K-1] (zeros for a fresh one), the same on every rank. Ranks all-gather their last K-1
    inputs; a slice shorter than K-1 passes on its predecessors' too, so any cut works."""
    rank = dist.get_rank(group)
    K1 = conv_state.shape[-1]
    tail = torch.cat([conv_state.to(x.dtype), x], dim=-1)[..., -K1:] if K1 else conv_state.to(x.dtype)
    lengths = torch.tensor([x.shape[-1]], device=x.device)
    tails, sizes = all_gather(tail, group), all_gather(lengths, group)
    window = conv_state.to(x.dtype)
    for r in range(rank):       # each predecessor's last K-1 inputs after the window so far
        n = int(sizes[r])
        window = torch.cat([window, tails[r][..., K1 - min(n, K1):]], dim=-1)[..., -K1:] if K1 else window
    return window
