"""Record every aten op one model step dispatches: which module issued it, the ouro source lines
that led to it, an identity of its inputs (op + argument contents), its FLOPs and bytes.

The identity is what makes "the same computation on the same inputs" visible: tensors are named
by shape, dtype, strides and a content digest (parameters by their storage, which does not change
during inference; large mutable tensors such as the caches by storage + version counter).
"""

from __future__ import annotations

import hashlib
import math
import sys
from dataclasses import dataclass
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from ...layers.merged import merged_sources
from ...layers.watch import passive
from ..call_trace import repo_path
from .native_cost import NATIVE_BYTES, NATIVE_FLOPS, NATIVE_WEIGHT_READS

STACK_DEPTH = 8
DIGEST_MAX_NUMEL = 1 << 18      # larger mutable tensors are named by storage + version instead

# ops that compute nothing: views, metadata, allocation
NO_COMPUTE = {
    "view", "reshape", "_reshape_alias", "expand", "t", "transpose", "permute", "slice", "select", "detach",
    "alias", "_unsafe_view", "as_strided", "empty", "empty_like", "empty_strided", "new_empty",
    "new_empty_strided", "unsqueeze", "squeeze", "split", "split_with_sizes", "chunk", "unbind", "narrow",
    "lift_fresh", "lift_fresh_copy", "unfold", "diagonal", "view_as_real", "view_as_complex", "_local_scalar_dense",
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "resize_", "set_", "clone_view",
}
# ops that read only the rows their index names, not the whole indexed tensor (e.g. the cache)
GATHER_LIKE = {"index", "index_select", "gather", "embedding", "take"}
SCATTER_LIKE = {"index_put", "index_put_", "_index_put_impl_", "index_copy", "index_copy_", "scatter",
                "scatter_", "index_add_", "index_fill_", "masked_scatter_"}


@dataclass
class OpRecord:
    index: int
    op: str                      # aten name without overload, e.g. "mm"
    module: str                  # innermost module path, "(model)" for the root, "(driver)" outside it
    stack: tuple                 # ouro frames, innermost first: ((file, function, line), ...)
    key: tuple | None            # identity of op + inputs (None: not hashed)
    flops: float
    matmul_flops: float
    bytes: float
    compute: bool                # False for views/metadata/allocation
    inputs_from: tuple = ()      # indices of the ops that last wrote its input tensors' storage
    weights: bool = False        # reads a parameter, a buffer, or a tensor computed from them alone
    # ((storage of a parameter or buffer, bytes of it the op reads), ...): a gather reads the rows
    # it produces, any other op the whole view it is given; a oneDNN packed copy of a weight
    # (`gemm_pick.packed_for`) is read as the weight (or the expert's slice of it) it was packed from
    weight_reads: tuple = ()

    @property
    def frame(self):
        return self.stack[0] if self.stack else ("?", "?", 0)


def ouro_stack(skip_lab: bool = True, depth: int = STACK_DEPTH) -> tuple:
    """The calling frames inside the ouro package (not the lab's or the tracer's), innermost first."""
    out = []
    f = sys._getframe(1)
    while f is not None and len(out) < depth:
        path = repo_path(f.f_code.co_filename, skip_observers=skip_lab)
        if path is not None:
            out.append((path, f.f_code.co_name, f.f_lineno))
        f = f.f_back
    return tuple(out)


class ModuleStack:
    """Forward pre/post hooks on every named module keep the path of the module running now."""

    def __init__(self, model: torch.nn.Module):
        self.names = ["(driver)"]
        self.io_bytes: dict[str, float] = {}   # bytes of each module's inputs + outputs, summed over calls
        self.handles = []
        for name, mod in model.named_modules():
            label = name or "(model)"
            # passive (`ouro.layers.watch`): the fused paths stay on, so the ops recorded are the ones a user runs
            self.handles.append(mod.register_forward_pre_hook(passive(lambda m, a, n=label: self._push(n, a))))
            self.handles.append(mod.register_forward_hook(passive(lambda m, a, o: self._pop(o))))

    def _push(self, name, args):
        self.names.append(name)
        self._count(name, args)

    def _pop(self, out):
        if len(self.names) > 1:
            self._count(self.names.pop(), out)

    def _count(self, name, x):
        self.io_bytes[name] = self.io_bytes.get(name, 0.0) + sum(
            _nbytes(t) for t in _tensors(x) if t.is_floating_point())

    @property
    def current(self) -> str:
        return self.names[-1]

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []


# the C methods themselves: host_sync wraps the Python attributes while a step is recorded
_TO_CPU, _TO_NUMPY = torch.Tensor.cpu, torch.Tensor.numpy


def _storage(t: torch.Tensor) -> int:
    """A key for the memory `t` lives in. oneDNN's packed weights (`gemm_pick.pack`, opaque
    tensors with no storage to ask) are keyed by the tensor object itself."""
    return t.untyped_storage().data_ptr() if t.layout == torch.strided else id(t)


def _digest(t: torch.Tensor) -> str:
    flat = t.detach().reshape(-1).contiguous()
    raw = flat.view(torch.uint8) if flat.numel() else flat
    return hashlib.blake2b(_TO_NUMPY(_TO_CPU(raw)).tobytes(), digest_size=8).hexdigest()


class OpRecorder(TorchDispatchMode):
    """Use as `with OpRecorder(model) as rec: step()`; `rec.ops` is the list of `OpRecord`s."""

    def __init__(self, model: torch.nn.Module, hash_inputs: bool = True):
        super().__init__()
        self.model, self.hash_inputs = model, hash_inputs
        self.param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.param_storages |= {b.untyped_storage().data_ptr() for b in model.buffers()}
        self.ops: list[OpRecord] = []
        self._writer: dict[int, int] = {}   # storage -> index of the op that last wrote it
        self._weights = set(self.param_storages)   # + storages last written from weights alone (casts, copies)
        self.listeners = []      # callables(func_name, args, kwargs, out, record) for other probes
        self.modules = None
        self._packs: dict = {}   # id(packed copy) -> (storage of its weight, bytes), or None: not one

    def __enter__(self):
        self.modules = ModuleStack(self.model)
        self._merged, self._unmerged = merged_sources(), set()   # merges made during the step: `_merged_of`
        return super().__enter__()

    def __exit__(self, *exc):
        self.modules.remove()
        return super().__exit__(*exc)

    # --- identity of an argument ---
    def _arg_key(self, a):
        if isinstance(a, torch.Tensor):
            if a.layout != torch.strided:       # a packed copy of a weight: as constant as one
                return ("param", id(a), tuple(a.shape), str(a.dtype))
            base = (tuple(a.shape), str(a.dtype), tuple(a.stride()))
            ptr = a.untyped_storage().data_ptr()
            if ptr in self.param_storages:
                return ("param", ptr, a.storage_offset()) + base
            if a.numel() > DIGEST_MAX_NUMEL:
                return ("storage", ptr, a.storage_offset(), a._version) + base
            return ("data", _digest(a)) + base
        if isinstance(a, (list, tuple)):
            return tuple(self._arg_key(x) for x in a)
        if isinstance(a, (int, float, bool, str, type(None))):
            return a
        return str(a)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        compute = name not in NO_COMPUTE
        key = None
        if compute and self.hash_inputs:
            key = (name, self._arg_key(args), tuple(sorted((k, self._arg_key(v)) for k, v in kwargs.items())))
        out = func(*args, **kwargs)
        written = []
        if compute and not isinstance(out, torch.Tensor) and not isinstance(out, (tuple, list)):
            written = _written_args(func, args)      # an op that writes into its arguments and returns nothing
            if not written:
                compute, key = False, None          # returns a scalar / nothing: metadata
        if compute and _aliases_input(out, args):   # a view op not in the list
            compute, key = False, None
        flops, mm_flops = _flops(func, name, args, kwargs, out) if compute else (0.0, 0.0)
        index = len(self.ops)
        sources = {self._writer.get(_storage(t)) for t in _tensors(args)}
        sources.discard(None)
        weight_in = [t.layout != torch.strided or _storage(t) in self._weights for t in _tensors(args) if t.numel()]
        rec = OpRecord(index, name, self.modules.current, ouro_stack(), key,
                       flops, mm_flops, _bytes(name, args, kwargs, out) if compute else 0.0, compute,
                       tuple(sorted(sources)), any(weight_in),
                       self._weight_reads(name, args, kwargs, out) if compute else ())
        if compute:   # views keep their storage's writer; computing ops (in-place ones too) become it
            derived = bool(weight_in) and all(weight_in)
            for t in list(_tensors(out)) + written:
                self._writer[_storage(t)] = index
                if derived:
                    self._weights.add(_storage(t))
                elif _storage(t) not in self.param_storages:   # a storage freed and reused for activations
                    self._weights.discard(_storage(t))
        self.ops.append(rec)
        for listen in self.listeners:
            listen(name, args, kwargs, out, rec)
        return out

    def _weight_reads(self, name, args, kwargs, out) -> tuple:
        reads = []
        partial = NATIVE_WEIGHT_READS[name](args) if name in NATIVE_WEIGHT_READS else {}
        for i, t in enumerate(list(_tensors(args)) + list(_tensors(kwargs))):
            if i in partial:
                reads.append((_storage(t), partial[i]))
                continue
            if t.layout != torch.strided:
                source = self._packed_source(t)
                if source is not None and source[0] in self._merged:      # a merged weight's packed copy
                    reads += [(_storage(w), n) for w, n in self._merged[source[0]]]
                elif source is not None:
                    reads.append(source)
            elif t.numel() and t.dim() >= 2 and self._merged_of(t):     # a merged product's weight: its sources'
                reads += [(_storage(w), n) for w, n in self._merged[_storage(t)]]
            elif t.numel() and _storage(t) in self.param_storages:
                gathered = name in GATHER_LIKE and i == 0
                reads.append((_storage(t), sum(_nbytes(o) for o in _tensors(out)) if gathered else _nbytes(t)))
        return tuple(reads)

    def _merged_of(self, t) -> bool:
        ptr = t if isinstance(t, int) else _storage(t)
        if ptr not in self._merged and ptr not in self._unmerged:
            self._merged = merged_sources()          # a merge made on first use, during this step
            if ptr not in self._merged:
                self._unmerged.add(ptr)
        return ptr in self._merged

    def _packed_source(self, t):
        if id(t) not in self._packs:     # packed since the last look (packs are made on first use)
            from ...machine.packs import _PACKS
            for key, packs in list(_PACKS.values()):
                i = 0
                for ptr, _version, dtype, shape in key:
                    n = shape[0] if len(shape) == 3 else 1
                    per = math.prod(shape[-2:]) * torch.empty((), dtype=dtype).element_size()
                    for pk in packs[i:i + n]:
                        if ptr in self.param_storages or self._merged_of(ptr):
                            self._packs[id(pk)] = (ptr, float(per))
                    i += n
            self._packs.setdefault(id(t), None)
        return self._packs[id(t)]


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)


def _written_args(func, args) -> list:
    """The tensor arguments an op's schema marks as written (`Tensor(a!)`), e.g. a native op storing
    into a cache in place."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    return [a for a, spec in zip(args, schema.arguments)
            if isinstance(a, torch.Tensor) and spec.alias_info is not None and spec.alias_info.is_write]


def _aliases_input(out, args) -> bool:
    outs = list(_tensors(out))
    if not outs or not all(isinstance(o, torch.Tensor) for o in outs):
        return False
    ptrs = {_storage(t) for t in _tensors(args) if t.numel()}
    o = outs[0]
    return o.numel() > 0 and _storage(o) in ptrs and o.data_ptr() != 0 and \
        not _is_inplace_target(out, args)


def _is_inplace_target(out, args) -> bool:
    # in-place ops return their first argument: they compute, they are not views
    return bool(args) and isinstance(args[0], torch.Tensor) and isinstance(out, torch.Tensor) and out is args[0]


def _nbytes(t: torch.Tensor) -> float:
    return float(t.numel() * t.element_size())


def _bytes(name, args, kwargs, out) -> float:
    """Bytes read + written. Gathers read only the rows they produce; scatters touch only the rows
    they write (not the whole cache tensor they index into)."""
    if name in NATIVE_BYTES:
        return NATIVE_BYTES[name](args, out)
    outs = list(_tensors(out))
    if name in GATHER_LIKE:
        idx = sum(_nbytes(t) for t in list(_tensors(args))[1:] if not t.is_floating_point())
        return 2 * sum(_nbytes(t) for t in outs) + idx
    if name in SCATTER_LIKE:
        rest = list(_tensors(args))[1:] + list(_tensors(kwargs))
        return 2 * sum(_nbytes(t) for t in rest)
    inputs = list(_tensors(args)) + list(_tensors(kwargs))
    written = 0.0 if outs and inputs and outs[0] is inputs[0] else sum(_nbytes(t) for t in outs)
    return sum(_nbytes(t) for t in inputs) + written


def _flops(func, name, args, kwargs, out):
    if name in NATIVE_FLOPS:     # a fused native op: the products inside it (torch sees one opaque call)
        f = float(NATIVE_FLOPS[name](args, out))
        return f, f
    counter = flop_registry.get(func._overloadpacket)
    if counter is not None:
        try:
            f = float(counter(*args, **kwargs, out_val=out))
            return f, f
        except Exception:   # an unusual overload: fall back to the element count
            pass
    outs = [t for t in _tensors(out)]
    ins = [t for t in _tensors(args) if t.is_floating_point()]
    return float(max([t.numel() for t in outs + ins[:1]], default=0)), 0.0
