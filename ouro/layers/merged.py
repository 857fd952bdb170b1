"""Several projections of the same input as one wider product (q/k/v, KDA's f_a/g_a/b, gate/up,
MLA's q_a with kv_a): at decode a product's per-call cost, not its bytes, set its time (the int8
kernel reached 19-44% of stream bandwidth on 512-wide weights), so fewer, wider calls pay.

The checkpoint's layout does not change: each projection stays its own module with its own
weights (state dicts, hooks, TP shards and quantisation see them as before). The merged module is
made from them on first use and kept outside the model (`_MERGED`), remade when any of their
tensors changes (a load, a re-quantisation, an in-place update). A class takes part by defining
`merge(modules) -> module or None` (`Linear`, `W8A8Linear`); groups of other or mixed classes,
watched modules (a probe's hooks must see each projection run), autograd and
`ouro.native.kernels.eager_only()` (the eager reference) run each projection on its own.

`merged_sources()` maps a merged weight's storage to its sources, so the lab's op recorder counts
a merged product's reads as reads of the checkpoint's weights."""

from __future__ import annotations

import weakref

import torch

from ..native.kernels import fused_off
from .watch import watched

_MERGED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _key(modules) -> tuple:
    # an inference tensor has no version counter (and cannot change in place outside inference mode)
    # the modules' own tensor dicts read directly: `parameters(recurse=False)` costs ~10x more, once
    # per projection group per step
    return tuple((id(m), t.data_ptr(), 0 if t.is_inference() else t._version, tuple(t.shape))
                 for m in modules for d in (m._parameters, m._buffers) for t in d.values() if t is not None)


def merged_module(modules):
    """The one module computing all of `modules`' outputs side by side, or None. Inside a compiled
    graph's trace: the one made for the same modules before it (`graph_merged`), or None."""
    if torch.compiler.is_compiling():
        return graph_merged(modules)
    cls = type(modules[0])
    if not hasattr(cls, "merge") or any(type(m) is not cls for m in modules):
        return None
    key = _key(modules)
    hit = _MERGED.get(modules[0])
    if hit is None or hit[0] != key:
        with torch.inference_mode(False), torch.no_grad():   # a plain tensor: packed copies key on its version
            hit = (key, cls.merge(modules), [weakref.ref(m) for m in modules])
        _MERGED[modules[0]] = hit
        # for a compiled graph's trace, which cannot key on storage pointers (`graph_merged`)
        modules[0].__dict__["_graph_merged"] = (tuple(modules), hit[1])
    return hit[1]


def graph_merged(modules):
    """The merged module last made for exactly `modules` (the decode graph runs the step eagerly
    once before tracing), or None. The trace keeps its weights: a weight changed in place after
    that needs the graph made again."""
    hit = getattr(modules[0], "_graph_merged", None)
    if hit is None or len(hit[0]) != len(modules) or any(a is not b for a, b in zip(hit[0], modules)):
        return None
    return hit[1]


def bound_merged(model) -> list:
    """The merged modules `graph_merged` hands a trace of `model`'s forward."""
    hits = (m.__dict__.get("_graph_merged") for m in model.modules())
    return [hit[1] for hit in hits if hit is not None and hit[1] is not None]


def _merges(modules) -> bool:
    return not torch.is_grad_enabled() and not fused_off() and not watched(*modules)


def project(x, *modules):
    """(modules[0](x), modules[1](x), ...), as one product where they can share one."""
    if len(modules) > 1 and _merges(modules):
        m = merged_module(modules)
        if m is not None:
            return m(x).split([p.out_features for p in modules], dim=-1)
    return tuple(p(x) for p in modules)


def project_cat(x, *modules):
    """torch.cat([m(x) for m in modules], -1), as one product where they can share one (no split and
    re-join: the merged output is the concatenation)."""
    if _merges(modules):
        m = merged_module(modules)
        if m is not None:
            return m(x)
    return torch.cat([p(x) for p in modules], dim=-1)


def _matrix(module):
    return next((t for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)) if t.dim() >= 2), None)


def merged_sources() -> dict:
    """{storage pointer of a live merged weight: [(a source module's weight, its bytes), ...]}."""
    out = {}
    for key, merged, refs in list(_MERGED.values()):
        sources = [_matrix(r()) for r in refs if r() is not None]
        weight = _matrix(merged) if merged is not None else None
        if weight is not None and len(sources) == len(refs) and all(t is not None for t in sources):
            out[weight.untyped_storage().data_ptr()] = [(t, float(t.numel() * t.element_size())) for t in sources]
    return out
