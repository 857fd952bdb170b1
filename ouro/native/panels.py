"""The float32 product of a decode step's rows on a weight packed into panels of columns
(`panels.cpp`): each weight value read once and met by every row in registers, each output one chain
of fused multiply-adds in order of k on every path (the same bits at any thread count, whatever rows
share the call). `ouro.machine.gemm_pick` offers it as the `panels` form for a decode step's rows (`gemm_pick.PANEL_ROWS`) and
keeps it where it measures fastest; the op keeps each weight's packed copy (`panel_weight`)."""

from __future__ import annotations

from .kernels import ops, register_fakes, register_product, usable

FAMILY = "panels"


def can(*tensors) -> bool:
    return usable(FAMILY, *tensors)


def panel_linear(x, w):
    """x [M, K] @ w [N, K].T as a new contiguous [M, N] tensor (float32 CPU tensors)."""
    return ops(FAMILY).panel_linear(x, w)


def panel_weight(w):
    """w's packed copy from the op's cache (made on first use, again after an in-place change)."""
    return ops(FAMILY).panel_weight(w)


@register_fakes(FAMILY)
def _fakes():
    register_product("panel_linear")
