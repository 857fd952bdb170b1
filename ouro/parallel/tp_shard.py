"""Tensor (and expert) parallelism applied to a built model: `shard_model(model, group)` keeps this
rank's slice of every split weight and swaps in the modules that do the collectives
(`tp_layers`). The model files know nothing of it.

The splits (N ranks, rank r):
- KDA: heads. q/k/v, f_b, g_b and b projections column-parallel (output rows of the local heads),
  the q/k/v conv kernels, `dt_bias` and `A_log` sliced with the heads, the low-rank f_a / g_a
  projections replicated, the per-head gated norm local, o_proj row-parallel (one all-reduce);
  the recurrent state holds the local heads only (`rank_config`: the state pool shrinks per rank).
- DSA/MLA: attention heads. q_b and kv_b column, o_proj row. The latent cache and the indexer are
  replicated: the latent row is one per token (not per head), so splitting it would need a
  gather before every attention; the indexer is small (its scores pick tokens for all heads).
- Dense MLP and the shared expert: gate/up column, down row. Routed experts: every expert's
  intermediate channels split (tp), or whole experts per rank (`ep`). mHC, norms and the router
  replicated.
- Embedding and lm_head vocabulary-parallel; the vocabulary is padded up to a multiple of N.

Every split that does not divide is refused before anything changes, with the numbers."""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import nn

from ..layers.dsa import DSAttention
from ..layers.kda import KDAttention
from ..layers.linear import Linear
from ..layers.moe import MLP, MoE
from .tp_layers import (RowParallelLinear, ShardedMoE, VocabParallelEmbedding, VocabParallelLMHead, group_key,
                        row_parallel_reduce)


def check_split(config, size: int, ep: bool = False) -> None:
    """Raise ValueError naming every count that `size` ranks cannot split evenly."""
    if size < 1:
        raise ValueError(f"tensor parallel size must be >= 1, got {size}")
    c = config
    counts = [("KDA heads (linear_num_heads)", c.linear_num_heads), ("attention heads (num_attention_heads)", c.num_attention_heads),
              ("dense MLP channels (intermediate_size)", c.intermediate_size),
              ("shared expert channels (moe_intermediate_size * n_shared_experts)", c.moe_intermediate_size * c.n_shared_experts)]
    counts.append(("routed experts (n_routed_experts)", c.n_routed_experts) if ep else
                  ("expert channels (moe_intermediate_size)", c.moe_intermediate_size))
    bad = [f"{name} = {n}" for name, n in counts if n % size]
    if bad:
        raise ValueError(f"--tp {size}{' --ep ' + str(size) if ep else ''} does not divide: {'; '.join(bad)} "
                         f"(each must be a multiple of {size}); pick a size that divides them")


def rank_config(config, size: int):
    """The config one rank's cache and memory plan are laid out for: its KDA and attention heads."""
    return dataclasses.replace(config, linear_num_heads=config.linear_num_heads // size,
                               num_attention_heads=config.num_attention_heads // size)


def _rows(t, rank: int, size: int, dim: int = 0):
    n = t.shape[dim] // size
    return t.narrow(dim, rank * n, n).clone()


def _column(lin: nn.Linear, rank: int, size: int) -> None:
    lin.weight = nn.Parameter(_rows(lin.weight.data, rank, size), requires_grad=False)
    lin.out_features = lin.weight.shape[0]


def _row(lin: nn.Linear, rank: int, size: int, group, reduce: bool = True) -> None:
    lin.weight = nn.Parameter(_rows(lin.weight.data, rank, size, 1), requires_grad=False)
    lin.in_features = lin.weight.shape[1]
    if reduce:
        lin.__class__ = RowParallelLinear
        lin.group = group
        lin.register_forward_hook(functools.partial(row_parallel_reduce, group=group, key=group_key(group)))


def _param(module, name: str, rank: int, size: int, dim: int = 0) -> None:
    setattr(module, name, nn.Parameter(_rows(getattr(module, name).data, rank, size, dim), requires_grad=False))


def _shard_kda(m: KDAttention, rank, size, group) -> None:
    for lin in (m.q_proj, m.k_proj, m.v_proj, m.f_b_proj, m.g_b_proj, m.b_proj):
        _column(lin, rank, size)
    for conv in (m.q_conv1d, m.k_conv1d, m.v_conv1d):
        _param(conv, "weight", rank, size)
    _param(m, "dt_bias", rank, size)
    _param(m, "A_log", rank, size)
    _row(m.o_proj, rank, size, group)
    m.H //= size


def _shard_dsa(m: DSAttention, rank, size, group) -> None:
    _column(m.q_b_proj, rank, size)
    _column(m.kv_b_proj, rank, size)
    _row(m.o_proj, rank, size, group)
    m.H //= size


def _shard_mlp(m: MLP, rank, size, group, reduce: bool = True) -> None:
    _column(m.gate_proj, rank, size)
    _column(m.up_proj, rank, size)
    _row(m.down_proj, rank, size, group, reduce)


def _shard_moe(m: MoE, rank, size, group, ep: bool) -> None:
    if m.shared_experts is not None:
        _shard_mlp(m.shared_experts, rank, size, group, reduce=False)    # summed with the experts' partials
    e = m.experts
    E, two_i, _ = e.gate_up_proj.shape
    if ep:
        _param(e, "gate_up_proj", rank, size)
        _param(e, "down_proj", rank, size)
        m.first_expert, m.local_experts = rank * (E // size), E // size
    else:
        i = two_i // 2
        gate, up = e.gate_up_proj.data[:, :i], e.gate_up_proj.data[:, i:]
        e.gate_up_proj = nn.Parameter(torch.cat([_rows(gate, rank, size, 1), _rows(up, rank, size, 1)], 1),
                                      requires_grad=False)
        _param(e, "down_proj", rank, size, 2)
    e.forms = None                     # measured forms were for the whole experts
    m.__class__ = ShardedMoE
    m.group, m.group_key, m.ep = group, group_key(group), ep


def _shard_vocab(model, rank, size, group) -> None:
    V = model.config.vocab_size
    n = -(-V // size)                  # rows per rank; the last rank's slice is padded past V
    first = rank * n

    def slice_rows(w):
        part = w[first:first + n]
        if part.shape[0] < n:
            part = torch.cat([part, part.new_zeros(n - part.shape[0], *part.shape[1:])])
        return nn.Parameter(part.clone(), requires_grad=False)
    emb = model.embed_tokens
    emb.weight = slice_rows(emb.weight.data)
    emb.num_embeddings = n
    emb.__class__ = VocabParallelEmbedding
    emb.group, emb.group_key, emb.first = group, group_key(group), first
    head = model.lm_head
    head.weight = slice_rows(head.weight.data)
    head.out_features = n
    head.__class__ = VocabParallelLMHead
    head.group, head.group_key, head.first, head.vocab = group, group_key(group), first, V
    head.candidates = 0                # on the instance from the start: a compiled step's guard sees one place


def shard_model(model, group, ep: bool = False):
    """Keep this rank's slices (rank and size from `group`) and swap in the parallel modules, in
    place; returns the model, whose `config` is now the rank's (`rank_config`; `full_config` the
    checkpoint's). size 1 leaves the model as it is."""
    import torch.distributed as dist
    return shard_for(model, dist.get_rank(group), dist.get_world_size(group), group, ep)


def rank_weight_bytes(config, size: int, ep: bool = False, dtype=torch.float32) -> int:
    """Bytes of weights rank 0 holds at `size` ranks (the largest share: the replicated parts and
    rank 0's slices), from a model built on the meta device and sharded by the same rules."""
    from ..models.glm5_next import Glm5NextModel
    with torch.device("meta"):
        model = Glm5NextModel(config).to(dtype)      # KeepFloat32 parts stay float32, as when loaded
    shard_for(model, 0, size, None, ep)
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def shard_for(model, rank: int, size: int, group, ep: bool = False):
    """shard_model with the place given: rank `rank` of `size` (group: where the collectives run;
    None for a model that only is measured)."""
    check_split(model.config, size, ep)
    if size == 1:
        return model
    for m in list(model.modules()):
        if isinstance(m, KDAttention):
            _shard_kda(m, rank, size, group)
        elif isinstance(m, DSAttention):
            _shard_dsa(m, rank, size, group)
        elif isinstance(m, MoE):
            _shard_moe(m, rank, size, group, ep)
    for m in list(model.modules()):
        if type(m) is MLP and not any(m is getattr(p, "shared_experts", None) for p in model.modules()):
            _shard_mlp(m, rank, size, group)
    _shard_vocab(model, rank, size, group)
    for m in model.modules():          # the measured product forms were for the whole weights
        if isinstance(m, Linear):
            m.forms = None
    model.full_config = model.config
    model.config = rank_config(model.config, size)
    model.tp_group, model.tp_rank, model.tp_size = group, rank, size
    return model
