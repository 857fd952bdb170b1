"""A module's eager forward as one opaque op inside a compiled graph.

The projections and the routed experts run the product this machine picked by measurement
(`ouro.machine.gemm_pick`: oneDNN on pre-packed weights, per-expert loops sized by host-read counts on a
CPU). A compiler cannot trace those (opaque oneDNN tensors, data-dependent loops), and inductor's
own GEMMs ran no faster here. So inside a compiled decode step such a module calls itself through
`ouro::opaque_call`, a custom op: the graph holds one extern call, the op runs the module's eager
path at run time, where on a CPU a host read costs nothing (`ouro.ops.capture.reads_host`). On an
accelerator the same eager path takes its sync-free forms, so a CUDA graph can capture it.

A module opts in with `opaque_key(module)` and two methods: `eager(*tensors)` (what runs) and
`eager_shape(*tensors)` (the output's shape and dtype, for tracing). Modules are held weakly.
"""

from __future__ import annotations

import itertools
import weakref

import torch

_MODULES: dict[int, "weakref.ref"] = {}
_KEYS = itertools.count(1)


def opaque_key(module) -> int:
    """The module's key in the registry, made on first use (an attribute on the module: a
    compiled graph reads it as a constant)."""
    key = module.__dict__.get("_opaque_key")
    if key is None or key not in _MODULES:
        key = next(_KEYS)
        module.__dict__["_opaque_key"] = key
        _MODULES[key] = weakref.ref(module, lambda _ref, k=key: _MODULES.pop(k, None))
    return key


def _module(key: int):
    m = _MODULES.get(key)
    m = m() if m is not None else None
    if m is None:
        raise RuntimeError(f"ouro::opaque_call: module {key} is gone (was the model freed while a compiled graph "
                           "that calls it was kept?)")
    return m


# a plain library op, not `torch.library.custom_op`: the dispatcher calls `_run` directly (a call
# from a compiled graph cost 16 us there against 6 us here, hot, for a 4 us module; more cold)
_LIB = torch.library.Library("ouro", "FRAGMENT")
_LIB.define("opaque_call(Tensor[] args, int key) -> Tensor")


def _run(args: list[torch.Tensor], key: int) -> torch.Tensor:
    out = _module(key).eager(*args)
    # an op's output may not alias its inputs
    return out.clone() if any(out.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
                              for a in args if a.numel() and out.numel()) else out


_LIB.impl("opaque_call", _run, "CompositeExplicitAutograd")


@torch.library.register_fake("ouro::opaque_call", lib=_LIB)
def _(args, key):
    shape, dtype = _module(key).eager_shape(*args)
    return args[0].new_empty(shape, dtype=dtype)


def opaque_call(args: list[torch.Tensor], key: int) -> torch.Tensor:
    return torch.ops.ouro.opaque_call(args, key)


def call_opaque(module, *args: torch.Tensor) -> torch.Tensor:
    """`module.eager(*args)` as one op (inside a compiled graph; outside, the same result). A
    graph builder registers its modules first (`opaque_key`), so tracing reads a constant."""
    key = module.__dict__.get("_opaque_key")
    return opaque_call(list(args), key if key is not None else opaque_key(module))
