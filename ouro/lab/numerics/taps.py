"""Forward taps: every named module's output, and every op function the layers call, recorded for
the probed sequence only and keyed by token position, so two runs compare whatever their
chunking, batching or decode steps were.

ouro's model runs over a flat batch: a tap finds the batch's `ForwardContext` in its callers'
frames (a layer may run on a sub-context, e.g. the decode half of a mixed batch) and takes the
probed sequence's rows by its KDA state slot. Ops are tapped by wrapping the `ouro.ops`
functions a layer module imported (its globals), restored afterwards. transformers' model runs
one sequence [1, S, ...]; its modules are matched to ouro's by name.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...layers.context import ForwardContext
from ...layers.watch import passive
from . import sub_taps
from .fused_taps import FUSED_OPS
from .sampler_taps import wrap_sampler
from .sub_taps import DERIVED, OP_ROLES, OURO_PARTS, parts, wrap_methods
from .tolerances import kind_of_module, kind_of_op

# op functions that return no per-token rows (weights, per-pool keys, KCP summaries, conv windows),
# and the KV cache's row codec (bytes in storage order, rows of the cache rather than of the batch)
NOT_PER_TOKEN = {"absorb_weights", "pool_keys", "slice_summary", "chain_states", "start_state", "last_columns",
                 "last_inputs", "encode_rows", "decode_rows"}
# modules outside ouro.layers whose op calls are a layer's: the context-parallel forms its hooks run
OP_CALL_SITES = ("ouro.parallel.cp_kda",)
# ops whose padded output is channels-first [B, C, T] (shape alone cannot tell when C == T)
CHANNELS_FIRST = {"causal_conv1d"}


@dataclass
class Recording:
    """Per key (module name, or `module.op`): position -> output row, plus what a finding needs."""
    n_experts: int
    width: int                                   # selection masks cover positions 0..width-1
    rows: dict = field(default_factory=dict)     # key -> [(positions [n], float32 rows [n, ...])]
    first_call: dict = field(default_factory=dict)   # key -> (forward index, event index)
    kinds: dict = field(default_factory=dict)
    sources: dict = field(default_factory=dict)  # key -> (file, function, line)
    ops: set = field(default_factory=set)        # keys that are op taps
    op_at: dict = field(default_factory=dict)    # op key -> {position: the op that computed it} (OP_ROLES)
    op_sources: dict = field(default_factory=dict)   # op name -> (file, function, line)
    fused_at: dict = field(default_factory=dict)  # key -> {position: the fused native op that computed it}
    forward_index: int = 0
    _events: int = 0

    def add(self, key: str, rows: torch.Tensor, positions) -> None:
        if key not in self.first_call:
            self.first_call[key] = (self.forward_index, self._events)
        self._events += 1
        if not rows.is_floating_point():   # token indices -> membership mask over the context
            rows = selection_mask(rows, self.width)
        self.rows.setdefault(key, []).append((positions.cpu(), rows.detach().float().cpu().clone()))

    def order(self) -> list[str]:
        """Keys in execution order; a key first seen in a later forward (a decode-only op) sits
        just before the module that encloses it."""
        first = {k: e for k, (f, e) in self.first_call.items() if f == 0}
        rank = {}
        for k, (f, e) in self.first_call.items():
            if f == 0:
                rank[k] = float(e)
                continue
            parent = k
            while "." in parent and parent not in first:
                parent = parent.rsplit(".", 1)[0]
            rank[k] = first.get(parent, float(1e9)) - 0.5 + e * 1e-9
        return sorted(rank, key=rank.get)

    def merge(self, parts: list[Recording]) -> None:
        """Take in the recordings of a context-parallel run's ranks (each tapped its own slice at
        global positions), in rank order: rows join, the first rank's order of first calls stands."""
        for part in parts:
            for key, rows in part.rows.items():
                self.rows.setdefault(key, []).extend(rows)
            for name in ("first_call", "kinds", "sources", "op_sources"):
                for k, v in getattr(part, name).items():
                    getattr(self, name).setdefault(k, v)
            for k, at in part.op_at.items():
                self.op_at.setdefault(k, {}).update(at)
            for k, at in part.fused_at.items():
                self.fused_at.setdefault(k, {}).update(at)
            self.ops |= part.ops
        self.forward_index = max([self.forward_index, *(p.forward_index for p in parts)])

    def stacked(self, key: str):
        """(sorted positions, [n, ...] rows; a position written twice keeps its last row) or None
        when rows of differing shapes were seen."""
        parts = self.rows.get(key)
        if not parts or len({tuple(r.shape[1:]) for _, r in parts}) != 1:
            return None
        pos = torch.cat([p for p, _ in parts])
        rows = torch.cat([r for _, r in parts])
        last = {int(p): i for i, p in enumerate(pos.tolist())}
        order = sorted(last)
        return order, rows[torch.tensor([last[p] for p in order], dtype=torch.long)]


def selection_mask(idx: torch.Tensor, width: int) -> torch.Tensor:
    idx = idx.long().reshape(idx.shape[0], -1)
    mask = torch.zeros(idx.shape[0], width + 1)
    mask.scatter_(1, torch.where((idx >= 0) & (idx < width), idx, width), 1.0)
    return mask[:, :width]


def canonical(out, n_experts: int, pick: int | None = None):
    """The one tensor a module's output is compared by: routing tuples (weights, expert ids) become
    dense [T, E] weights; otherwise the first tensor (or `pick`) of a tuple."""
    if isinstance(out, (tuple, list)):
        if pick is not None:
            return out[pick]
        ts = [t for t in out if isinstance(t, torch.Tensor)]
        for a, b in zip(ts, ts[1:]):
            if a.is_floating_point() and not b.is_floating_point() and a.shape == b.shape:
                dense = torch.zeros(*a.shape[:-1], n_experts, dtype=torch.float32, device=a.device)
                return dense.scatter_(-1, b.long(), a.float())
        return ts[0] if ts else None
    return out if isinstance(out, torch.Tensor) else None


def repo_relative(path: str) -> str:
    root = Path(importlib.import_module("ouro").__file__).resolve().parent.parent
    try:
        return str(Path(path).resolve().relative_to(root))
    except ValueError:
        return str(path)


def source_of(obj) -> tuple[str, str, int] | None:
    """(repo-relative file, function name, line) of a function or of a module class's forward."""
    fn = obj if inspect.isfunction(obj) else getattr(type(obj), "forward", None)
    return _source(inspect.unwrap(fn)) if fn is not None else None


@functools.lru_cache(maxsize=None)
def _source(fn):
    try:
        return repo_relative(inspect.getsourcefile(fn)), fn.__name__, inspect.getsourcelines(fn)[1]
    except (TypeError, OSError):
        return None


def _find_local(name: str, kind, depth: int = 14, start: int = 2):
    f = sys._getframe(start)
    for _ in range(depth):
        if f is None:
            return None
        v = f.f_locals.get(name)
        if isinstance(v, kind):
            return v
        f = f.f_back
    return None


def probed_rows(t: torch.Tensor, ctx: ForwardContext, slots: set, channels_first: bool = False):
    """(rows [n, ...], positions [n]) of the probed sequences in a flat [T, ...], padded
    [B, Tmax, ...] or channels-first padded [B, C, Tmax] tensor; None if none is there."""
    bs = [b for b, s in enumerate(ctx.state_slots_list) if s in slots]
    if not bs or t.dim() == 0:
        return None
    T, B, Tmax = int(ctx.cu_seqlens[-1]), len(ctx.query_lens), max(ctx.query_lens)
    if t.shape[0] == T and not (channels_first and t.dim() >= 3 and t.shape[2] == Tmax):
        if len(bs) == B:        # every row is the probed sequence's (it runs alone)
            return t, ctx.positions.cpu()
        rows = torch.cat([torch.arange(int(ctx.cu_seqlens[b]), int(ctx.cu_seqlens[b + 1])) for b in bs])
        return t[rows.to(t.device)], ctx.positions[rows.to(ctx.positions.device)].cpu()
    if t.dim() >= 3 and t.shape[0] == B and t.shape[2] == Tmax and (channels_first or t.shape[1] != Tmax):
        t = t.movedim(2, 1)
    if t.dim() >= 2 and t.shape[0] == B and t.shape[1] == Tmax:
        parts = [t[b, :ctx.query_lens[b]] for b in bs]
        pos = [torch.arange(ctx.query_lens[b]) + ctx.start_pos[b] for b in bs]
        return torch.cat(parts), torch.cat(pos)
    return None


def op_names() -> set[str]:
    """Names of the functions `ouro.ops` defines: a layer global of that name is an op call site
    (whatever it is bound to now, e.g. a patched replacement)."""
    from ... import ops
    names = set()
    for info in pkgutil.walk_packages(ops.__path__, "ouro.ops."):
        module = importlib.import_module(info.name)
        names |= {n for n, f in vars(module).items()
                  if inspect.isfunction(f) and f.__module__ == info.name and not n.startswith("_")}
    return names


class OuroTaps:
    """Hooks on every named submodule of an ouro `Glm5NextModel`, wrappers on its layers' ops and
    on the methods `sub_taps.METHODS` names.
    `slots()` returns the KDA state slots of the probed sequence's requests right now. While
    installed the model computes every row's logits (the caller still gets the rows it asked)."""

    def __init__(self, model, rec: Recording, slots, passive_hooks: bool = False):
        self.model, self.rec, self.slots = model, rec, slots
        self.passive_hooks = passive_hooks     # keep every fused op on (`ouro.layers.watch`)
        self.names = {id(m): n for n, m in model.named_modules() if n}
        self.modules = set(self.names.values())
        self.handles, self.patched = [], []

    def __enter__(self):
        for name, mod in self.model.named_modules():
            if name:
                hook = self._module_hook(name, mod)
                self.handles.append(mod.register_forward_hook(passive(hook) if self.passive_hooks else hook))
                self.rec.kinds[name] = kind_of_module(name, type(mod).__name__)
                self.rec.sources[name] = source_of(mod)
        self.handles.append(self.model.register_forward_pre_hook(self._pre))
        self.handles.append(self.model.register_forward_hook(self._post))
        self._wrap_ops()
        self.patched += wrap_methods(lambda owner, method, fn, out: self._record_op(owner, method, method, fn, out))
        self.patched += wrap_sampler(self.rec, self.slots, source_of)
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        for module, name, fn in reversed(self.patched):
            setattr(module, name, fn)
        self.handles, self.patched = [], []

    def _pre(self, model, args):
        ctx = args[1]
        self._wanted, ctx.logits_index = ctx.logits_index, None

    def _post(self, model, args, out):
        self.rec.forward_index += 1
        return out if self._wanted is None else out[self._wanted]

    def _record(self, key, out, ctx, channels_first=False):
        t = canonical(out, self.rec.n_experts)
        if t is None or ctx is None:
            return
        got = probed_rows(t, ctx, set(self.slots()), channels_first)
        if got is not None:
            self.rec.add(key, *got)
            return got[1]
        return None

    def _module_hook(self, name, mod):
        def hook(m, args, out):
            ctx = _find_local("ctx", ForwardContext)
            for suffix, t in parts(type(m).__name__, out, OURO_PARTS):   # e.g. a hyper-connection's comb
                self.rec.kinds.setdefault(f"{name}.{suffix}", self.rec.kinds[name])
                self.rec.sources.setdefault(f"{name}.{suffix}", self.rec.sources[name])
                self._record(f"{name}.{suffix}", t, ctx)
            self._record(name, out, ctx)
        return hook

    def _wrap_ops(self):
        from ... import layers
        ops = op_names()
        sites = [f"ouro.layers.{info.name}" for info in pkgutil.iter_modules(layers.__path__)] + list(OP_CALL_SITES)
        for module in map(importlib.import_module, sites):
            for name, fn in list(vars(module).items()):
                if callable(fn) and name in ops and name not in NOT_PER_TOKEN:
                    self.patched.append((module, name, fn))
                    setattr(module, name, self._op_wrapper(name, fn))
        for module_name, op, emit, like in FUSED_OPS:
            module = importlib.import_module(module_name)
            fn = getattr(module, op)
            self.patched.append((module, op, fn))
            setattr(module, op, self._fused_wrapper(op, fn, emit, like))
        for module_name, op, local_names, suffix, derive in DERIVED:
            module = importlib.import_module(module_name)
            fn = getattr(module, op)
            self.patched.append((module, op, fn))
            setattr(module, op, self._derived_wrapper(fn, local_names, suffix, getattr(sub_taps, derive)))

    def _op_wrapper(self, op, fn):
        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            owner = _find_local("self", torch.nn.Module, depth=3)   # a CP hook calls ops 2 frames below the layer
            self._record_op(owner, op, OP_ROLES.get(op, op), fn, out)
            return out
        return wrapped

    def _fused_wrapper(self, op, fn, emit, like):
        """A fused native op (`fused_taps.FUSED_OPS`): its output recorded under the keys the eager
        path records it, each of its rows noted as this op's (`Recording.fused_at`)."""
        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            caller = sys._getframe(1).f_locals
            name = self.names.get(id(_find_local("self", torch.nn.Module, depth=3)))
            ctx = _find_local("ctx", ForwardContext, start=2)
            if name is None or ctx is None:
                return out
            self.rec.op_sources[op] = source_of(fn)
            with torch.no_grad():
                for key, t in emit(name, caller, out, self.names):
                    if t is None:      # the module's own hook records this output
                        got = probed_rows(canonical(out, self.rec.n_experts), ctx, set(self.slots()))
                        pos = None if got is None else got[1]
                    else:
                        self.rec.kinds.setdefault(key, kind_of_op(like or op))
                        if key not in self.modules:      # an op's or a method's key, as the eager path records it
                            self.rec.ops.add(key)
                        self.rec.sources.setdefault(key, source_of(fn))
                        pos = self._record(key, t, ctx)
                    if pos is not None:
                        self.rec.fused_at.setdefault(key, {}).update(dict.fromkeys(pos.tolist(), op))
            return out
        return wrapped

    def _derived_wrapper(self, fn, local_names, suffix, derive):
        """`sub_taps.DERIVED`: a module ouro does not call, its output made from the caller's locals
        and this op's output, recorded under `owner.suffix` with the op's source."""
        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            caller = sys._getframe(1).f_locals
            name = self.names.get(id(caller.get("self")))
            got = [caller.get(n) for n in local_names]
            ctx = caller.get("ctx")
            if name is not None and isinstance(ctx, ForwardContext) and all(isinstance(t, torch.Tensor) for t in got):
                key = f"{name}.{suffix}"
                self.rec.kinds.setdefault(key, kind_of_module(key, "Linear"))
                self.rec.sources[key] = source_of(fn)
                with torch.no_grad():
                    self._record(key, derive(*got, *(out if isinstance(out, tuple) else (out,)), ctx=ctx), ctx)
            return out
        return wrapped

    def _record_op(self, owner, op, role, fn, out):
        """An op (or a tapped method, `sub_taps.METHODS`) of module `owner`, under `owner.role`."""
        name = self.names.get(id(owner))
        if name is None:
            return
        key = f"{name}.{role}"
        self.rec.ops.add(key)
        self.rec.kinds[key] = kind_of_op(op)
        self.rec.sources[key] = self.rec.op_sources[op] = source_of(fn)
        pos = self._record(key, out, _find_local("ctx", ForwardContext, start=3), op in CHANNELS_FIRST)
        if pos is not None:
            self.rec.op_at.setdefault(key, {}).update(dict.fromkeys(pos.tolist(), op))
