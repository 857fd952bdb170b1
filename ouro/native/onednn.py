"""oneDNN's packed product as a native op (`onednn.cpp`): a compiled graph calls `packed_linear` on the
plain weight, and the op keeps the weight's packed copy (the one `ouro.machine.gemm_pick`'s eager
"packed" form reads too, `packed_weight`), so the product no longer goes back to Python through
`ouro::opaque_call`."""

from __future__ import annotations

import torch

from .kernels import load, ops, register_fakes, register_product, usable

FAMILY = "onednn"
MKLDNN = torch.backends.mkldnn.is_available()       # read once: a graph's trace cannot call it


def can(*tensors) -> bool:
    return MKLDNN and usable(FAMILY, *tensors)


def ready(w) -> bool:
    """Whether the op's cache can hold w's packed copy (built here, a CPU float32 or bfloat16 weight);
    unlike `can`, not switched by `eager_only()`: which copy the eager path reads changes no result."""
    return (w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16) and not torch.compiler.is_compiling()
            and MKLDNN and load(FAMILY))


def packed_linear(x, w):
    """x [M, K] @ w [N, K].T through w's packed copy, rows padded as `gemm_pick.row_bucket` pads them."""
    return ops(FAMILY).packed_linear(x, w)


def packed_weight(w):
    """w's packed copy from the op's cache (made on first use, again after an in-place change)."""
    return ops(FAMILY).packed_weight(w)


@register_fakes(FAMILY)
def _fakes():
    register_product("packed_linear")
