"""`ouro_native::packed_linear`: the oneDNN-packed product a compiled graph calls directly, against the
eager packed form (`gemm_pick.product(..., "packed", pack(w))`), bit for bit; its cache of packed
copies follows in-place changes and drops the copies of freed weights."""

import gc

import pytest
import torch

from ouro.machine import gemm_pick
from ouro.native import kernels, onednn

pytestmark = pytest.mark.skipif(not (onednn.MKLDNN and kernels.load("onednn")),
                                reason="oneDNN or the native op is not available here")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40, 129, 300])
@pytest.mark.parametrize("n,k", [(96, 64), (37, 72), (512, 512)])
def test_packed_linear_is_the_eager_packed_form(rows, n, k, dtype):
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=gen).to(dtype)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    with torch.inference_mode():
        got = onednn.packed_linear(x, w)
        want = gemm_pick.product(x, w, "packed", gemm_pick.pack(w))
    assert got.shape == (rows, n) and got.dtype == dtype
    assert not got.float().isnan().any()
    assert torch.equal(got, want)
    ref = x.double() @ w.double().T
    assert ((got.double() - ref).norm() / ref.norm()).item() < (1e-5 if dtype == torch.float32 else 2e-2)


def test_an_in_place_change_of_the_weight_is_seen():
    w = torch.randn(48, 32)
    x = torch.randn(5, 32)
    with torch.no_grad():
        before = onednn.packed_linear(x, w)
        w.mul_(-2.0)
        after = onednn.packed_linear(x, w)
    assert torch.allclose(after, -2.0 * before, rtol=1e-5, atol=1e-5)


def test_freed_weights_leave_the_cache_and_the_eager_form_shares_it():
    gc.collect()
    keep = torch.randn(40, 32)
    owner = torch.nn.Linear(32, 40)
    base = torch.ops.ouro_native.packed_cache_size()
    for _ in range(20):             # each weight freed before the next is packed
        w = torch.randn(64, 32)
        onednn.packed_linear(torch.randn(2, 32), w)
        del w
        gc.collect()
    onednn.packed_linear(torch.randn(2, 32), keep)
    assert torch.ops.ouro_native.packed_cache_size() <= base + 2
    # the eager packed form takes its copy from the same cache: no new entry for a weight the op has
    gemm_pick.packed_for(owner, [keep])
    assert torch.ops.ouro_native.packed_cache_size() <= base + 2


def test_a_strided_weight_is_packed_for_the_call_not_cached():
    """A transposed view's contiguous copy is a temporary: packing it each call is right, caching it is
    not (the entry would expire at once). Same result as the eager packed form."""
    base = torch.randn(32, 48)
    w = base.t()                    # [48, 32], not contiguous
    x = torch.randn(5, 32)
    size = torch.ops.ouro_native.packed_cache_size()
    with torch.inference_mode():
        got = onednn.packed_linear(x, w)
        want = gemm_pick.product(x, w.contiguous(), "packed", gemm_pick.pack(w.contiguous()))
    assert torch.equal(got, want)
    assert torch.ops.ouro_native.packed_cache_size() <= size
