"""The float32 product of a few rows with a weight, `x [M, K] @ w [N, K].T` (`gemv.cpp`): the weight
streamed once for all rows, every output summed in one fixed order (the same at any thread count and
whatever rows share the call). `ouro.machine.gemm_pick` offers it as the `gemv` form for up to `MAX_ROWS`
rows and keeps it where it measures fastest."""

from __future__ import annotations

from .kernels import ops, register_fakes, register_product, usable

FAMILY = "gemv"
MAX_ROWS = 8          # the row counts it is meant for (decode); more rows re-read each weight block per 4


def can(*tensors) -> bool:
    return usable(FAMILY, *tensors)


def gemv(x, w):
    """x [M, K] @ w [N, K].T as a new contiguous [M, N] tensor (float32 CPU tensors)."""
    return ops(FAMILY).gemv(x, w)


@register_fakes(FAMILY)
def _fakes():
    register_product("gemv")
