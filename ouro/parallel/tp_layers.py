"""The modules a tensor-parallel rank swaps in (`tp_shard.shard_model`): each holds its rank's
slice of a weight and does the one collective its split needs. They subclass the modules they
replace, so hooks, state-dict names and the lab's taps see the same model.

- `RowParallelLinear`: input features split, partial products summed by one all-reduce (a
  forward hook, `row_parallel_reduce`, which survives quantisation);
- `VocabParallelEmbedding`: rows of the vocabulary split; a token's row comes from the rank that
  holds it (the others add zeros), one all-reduce;
- `VocabParallelLMHead`: rows of the output layer split; the local logits are all-gathered into
  the full vocabulary (padding columns dropped) or, where the sampler needs only the best k
  tokens, each rank's k best (logit, id) pairs and log-sum-exp (`candidate_logits`);
- `ShardedMoE`: routed experts split by intermediate channels (TP) or whole experts per rank
  (EP), the shared expert by channels; every rank's partial output summed by one all-reduce.

The collectives run on `group` (a torch.distributed ProcessGroup); gloo on a CPU."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..layers.linear import Linear
from ..measure.spans import span
from ..ops.opaque import call_opaque
from ..layers.moe import MoE, with_shared


# seconds this process spent inside the collectives, by kind: what a TP run's time breakdown reads
COLLECTIVE_SECONDS = {"all_reduce": 0.0, "all_gather": 0.0}
# when a list: every collective appends (kind, shape, COLLECTIVE_WHERE()): the lab compares the ranks' logs
COLLECTIVE_LOG = None
COLLECTIVE_WHERE = None


def _log(kind: str, x) -> None:
    if COLLECTIVE_LOG is not None:
        COLLECTIVE_LOG.append((kind, tuple(x.shape), COLLECTIVE_WHERE() if COLLECTIVE_WHERE else ""))


# the groups the compiled collectives run on, by key: a compiled graph holds the key (an int
# constant), never the ProcessGroup object, which a trace cannot carry
_GROUPS: dict[int, object] = {}


def group_key(group) -> int:
    """`group`'s key in the registry, made on first use (at sharding time, not while tracing)."""
    for k, g in _GROUPS.items():
        if g is group:
            return k
    _GROUPS[len(_GROUPS) + 1] = group
    return len(_GROUPS)


def all_reduce(x, group, key: int = 0):
    """The sum over the group's ranks, in place; inside a compiled graph one opaque op
    (`ouro::tp_all_reduce`) that runs this same function when the graph runs."""
    if torch.compiler.is_compiling():
        return tp_all_reduce(x, key)
    _log("all_reduce", x)
    t0 = time.perf_counter()
    with span("all_reduce", cat="collective"):      # on the engine's trace (the timeline probe)
        dist.all_reduce(x, group=group)
    COLLECTIVE_SECONDS["all_reduce"] += time.perf_counter() - t0
    return x


def all_gather(x, group, key: int = 0) -> list:
    if torch.compiler.is_compiling():
        return list(tp_all_gather(x, key).unbind(0))
    _log("all_gather", x)
    t0 = time.perf_counter()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    with span("all_gather", cat="collective"):
        dist.all_gather(parts, x, group=group)
    COLLECTIVE_SECONDS["all_gather"] += time.perf_counter() - t0
    return parts


@torch.library.custom_op("ouro::tp_all_reduce", mutates_args=())
def tp_all_reduce(x: torch.Tensor, key: int) -> torch.Tensor:
    return all_reduce(x.clone(), _GROUPS[key])


@tp_all_reduce.register_fake
def _(x, key):
    return torch.empty_like(x)


@torch.library.custom_op("ouro::tp_all_gather", mutates_args=())
def tp_all_gather(x: torch.Tensor, key: int) -> torch.Tensor:
    """[ranks, *x.shape]"""
    return torch.stack(all_gather(x.contiguous(), _GROUPS[key]))


@tp_all_gather.register_fake
def _(x, key):
    return x.new_empty((dist.get_world_size(_GROUPS[key]), *x.shape))


class RowParallelLinear(Linear):
    """y = all_reduce(x_local @ W[:, local].T): x arrives split along its features. The sum is a
    forward hook (`row_parallel_reduce`), so a module that later replaces this one (a quantised
    projection: `quant.quantize_model` carries hooks over) keeps it."""
    group = None
    group_key = 0


def row_parallel_reduce(module, args, out, group=None, key: int = 0):
    """Forward hook of a row-parallel projection: the ranks' partial products summed."""
    return all_reduce(out, group, key)


class VocabParallelEmbedding(nn.Embedding):
    """Rows [first, first + n) of the vocabulary; other ids read zeros here."""
    group = None
    group_key = 0
    first = 0

    def forward(self, ids):
        local = ids - self.first
        mine = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(out, self.group, self.group_key)


class VocabParallelLMHead(Linear):
    """Output rows [first, first + n); `vocab` the real vocabulary (the last rank's slice may hold
    padding rows past it, whose logits never count). forward gathers the full logits [T, vocab].

    With `candidates` = k > 0 (set by the engine, on every rank alike, for a batch whose rows only
    need the k best tokens: greedy picks, top-k sampling) only each rank's k best (logit, id) pairs
    and its log-sum-exp cross (`candidate_logits`)."""
    group = None
    group_key = 0
    first = 0
    vocab = 0
    candidates = 0
    candidate_forwards = 0       # forwards that took the candidate path

    def local_logits(self, x):
        logits = super().forward(x)
        real = self.vocab - self.first
        if real < self.out_features:            # padding rows: never the pick, never in a softmax
            logits[..., max(real, 0):] = float("-inf")
        return logits

    def forward(self, x):
        if self.candidates:
            self.candidate_forwards += 1
            return self.candidate_logits(x, self.candidates)
        return torch.cat(all_gather(self.local_logits(x).contiguous(), self.group, self.group_key), -1)[..., :self.vocab]

    def candidate_logits(self, x, k: int):
        """[T, vocab] logits that agree with the full ones wherever a sampler with top_k <= k (or
        greedy) looks: the global top k are the true logits (every rank's local top k holds them);
        every other entry holds one filler value that carries the rest of the softmax mass, so a
        log-softmax still gives each candidate its true log-probability. The filler sits strictly
        below the k-th best, so neither an argmax nor a top-k filter ever picks it. Greedy (k = 1)
        takes each rank's first maximum: ties go to the lower id, as torch.argmax's."""
        local = self.local_logits(x).float()
        k = min(k, local.shape[-1])
        if k == 1:
            vals, idx = local.max(-1, keepdim=True)
        else:
            vals, idx = local.topk(k, dim=-1)
        pack = torch.cat([vals, (idx + self.first).float(), torch.logsumexp(local, -1, keepdim=True)], -1)
        allp = torch.stack(all_gather(pack.contiguous(), self.group, self.group_key), 1)           # [T, ranks, 2k + 1]
        T = allp.shape[0]
        cv, ci = allp[..., :k].reshape(T, -1), allp[..., k:2 * k].reshape(T, -1).long()
        total = torch.logsumexp(allp[..., 2 * k], -1)                                # the global normaliser
        real = torch.isfinite(cv) & (ci < self.vocab)
        cv = cv.masked_fill(~real, float("-inf"))
        n_rest = self.vocab - real.sum(-1)
        in_cand = torch.logsumexp(cv, -1)
        rest = total + torch.log1p(-torch.exp((in_cand - total).clamp(max=0.0)))      # log of the mass elsewhere
        filler = rest - torch.log(n_rest.clamp(min=1).float())
        # every non-candidate is at most the global k-th best (the global top k are candidates), so
        # their mean is too: the clamp only catches rounding, then one step down breaks a tie
        kth = cv.topk(min(k, cv.shape[-1]), dim=-1).values[:, -1]
        filler = torch.nextafter(torch.minimum(filler, kth), torch.full_like(filler, float("-inf")))
        filler = filler.masked_fill(n_rest == 0, float("-inf"))
        out = filler.unsqueeze(-1).expand(T, self.vocab + 1).clone()    # the last column takes what is not real
        out.scatter_(-1, ci.masked_fill(~real, self.vocab), cv)
        return out[:, :self.vocab]


def local_experts(x, weights, experts, module, first: int, n_local: int):
    """Expert parallelism: only experts [first, first + n_local) live here, in `module` (any
    experts form: `Experts`, or its quantised stand-in); returns the weighted sum of their outputs
    [T, D], choices of other experts adding 0. Each local (token, choice) pair becomes one row
    with a single choice, so the module runs only this rank's share of the work in its own form."""
    out = torch.zeros_like(x)
    local = (experts >= first) & (experts < first + n_local)
    t, j = local.nonzero(as_tuple=True)
    if t.numel() == 0:
        return out
    y = module(x[t], weights[t, j].unsqueeze(-1), (experts[t, j] - first).unsqueeze(-1))
    return out.index_add_(0, t, y)


class ShardedMoE(MoE):
    """The MoE block with its experts split across the group's ranks (`ep`: whole experts, else
    channels of every expert) and the shared expert split by channels; one all-reduce sums the
    ranks' partial outputs. The router is replicated: every rank routes every token alike."""
    group = None
    group_key = 0
    ep = False
    first_expert = 0
    local_experts = 0

    def forward(self, x):
        weights, experts = self.gate(x)
        e = self.experts
        if self.ep:          # which rows are local is data: inside a compiled graph, one opaque op
            routed = (call_opaque(self, x, weights, experts) if torch.compiler.is_compiling()
                      else self.eager(x, weights, experts))
        else:            # every expert's channel slice: the experts module as it is (its measured or quantised form)
            routed = e(x, weights, experts)
        return all_reduce(with_shared(self, routed, x), self.group, self.group_key)

    def eager(self, x, weights, experts):
        return local_experts(x, weights, experts, self.experts, self.first_expert, self.local_experts)

    def eager_shape(self, x, weights, experts):
        return x.shape, x.dtype
