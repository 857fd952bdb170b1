"""oneDNN's packed copies of weights (the `packed` product form, `gemm_pick`): made on first use, kept
outside their owner module and made again when a weight changes in place; one copy a weight, shared
with the native packed op's cache where it is built."""

from __future__ import annotations

import weakref

import torch

from ..native import onednn as native_onednn


def _count_packed_flops():
    """FLOPs of the packed product for torch's FlopCounterMode (the bench's FLOP counts and the
    lab's op recorder read its registry): 2 * rows * K * N, as for a matmul."""
    from torch.utils.flop_counter import flop_registry, register_flop_formula
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if op is None or op in flop_registry:
        return

    @register_flop_formula(op)
    def _(x_shape, w_shape, *args, out_shape=None, **kwargs):
        rows = 1
        for n in x_shape[:-1]:
            rows *= n
        return 2 * rows * x_shape[-1] * w_shape[0]


def pack(weight):
    """The weight reordered into oneDNN's blocked layout (an opaque tensor the same size)."""
    _count_packed_flops()
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def shared_pack(weight):
    """`pack(weight)`, from the native op's cache where it is built (`ouro.native.onednn`): the copy a
    compiled graph's `packed_linear` reads, so a weight has one packed copy, not two."""
    if native_onednn.ready(weight):
        return native_onednn.packed_weight(weight.detach())
    return pack(weight)


# owner module -> (key of the weights packed, packs): kept outside the module, so deepcopy and
# pickling of a model never meet oneDNN's opaque tensors, and a module's packs go with it
_PACKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def packed_for(owner, weights) -> list:
    """`pack(w)` of each 2-D weight in `weights` (a stacked [E, ...] tensor counts as E), made on
    first use and again whenever a weight changes in place (its version counter moves)."""
    key = tuple((w.data_ptr(), w._version, w.dtype, tuple(w.shape)) for w in weights)
    hit = _PACKS.get(owner)
    if hit is None or hit[0] != key:
        packs = [shared_pack(m) for w in weights for m in (w if w.dim() == 3 else [w])]
        _PACKS[owner] = hit = (key, packs)
    return hit[1]
