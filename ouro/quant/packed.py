"""Kernel-layout copies of quantised weights, kept beside their owner module: made once (by
`w8a8.prepack` at quantisation, or at first use), remade when the weight changes in place, and
readable inside a compiled graph's trace (`graph_pack`)."""

from __future__ import annotations

import weakref

from .int8_native import native


# owner module -> {weight name: (key of the int8 weight packed, its packed copy)}: outside the
# module (state dicts and deep copies never see it), remade when the weight changes in place
_PACKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _kernel_layout(qweight):
    return native().pack_weight(qweight if qweight.dim() == 3 else qweight.unsqueeze(0))


def packed_for(owner, qweight, name: str = "weight", make=_kernel_layout):
    """`make(qweight)` (default: ouro's kernel layout of an int8 [N, K] or stacked [E, N, K]
    weight), made once per owner and name."""
    key = (qweight.data_ptr(), qweight._version, tuple(qweight.shape))
    packs = _PACKED.setdefault(owner, {})
    if name not in packs or packs[name][0] != key:
        packs[name] = (key, make(qweight))
        if make is _kernel_layout:      # what a compiled graph's direct call reads (`graph_pack`)
            owner.__dict__.setdefault("_graph_packs", {})[name] = packs[name][1]
    return packs[name][1]


def graph_pack(owner, name: str):
    """Inside a compiled graph's trace: the kernel-layout copy `packed_for` last made for `owner`'s
    `name` (the decode graph runs the step eagerly once before tracing), or None. The trace keeps
    it as a constant: a weight changed in place after that needs the graph made again."""
    return getattr(owner, "_graph_packs", {}).get(name)
