"""The int8 kernel's kept buffers (`CallBuffers`, `quant/int8_products.h`): a decode-size projection
allocates only its output, and a call that reuses storage a larger call filled still equals the
exact reference."""

from __future__ import annotations

import pytest
import torch

from ouro.ops.quant import quantize_rows, w8a8_linear_naive
from ouro.quant.int8_native import native


def _packed_call(x, q, s):
    p = native().pack_weight(q.unsqueeze(0))
    return native().w8a8_packed(x, p, s, torch.zeros(0, dtype=torch.long), q.shape[0])


@pytest.mark.skipif(native() is None, reason="ouro's int8 kernel is not built here")
@pytest.mark.parametrize("k", [7, 64, 101])
def test_a_call_after_a_larger_one_reads_no_leftovers(k):
    """A decode-size call reuses the storage a larger call left full of other rows' values: every
    product (odd K included, whose padding column keeps a leftover) still equals the exact reference."""
    g = torch.Generator().manual_seed(k)
    big_q, big_s = quantize_rows(torch.randn(40, 2 * k + 3, generator=g))
    _packed_call(torch.randn(64, 2 * k + 3, generator=g) * 50, big_q, big_s)     # fills the kept slots
    q, s = quantize_rows(torch.randn(24, k, generator=g))
    for rows in (1, 3, 1):
        x = torch.randn(rows, k, generator=g)
        assert torch.equal(_packed_call(x, q, s), w8a8_linear_naive(x, q, s))


def _allocations(fn) -> int:
    with torch.profiler.profile() as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key in ("aten::empty", "aten::zeros", "aten::empty_strided",
                                                                 "aten::clone", "aten::empty_like"))


@pytest.mark.skipif(native() is None, reason="ouro's int8 kernel is not built here")
def test_decode_size_calls_allocate_only_their_output():
    """A decode step's projection makes no tensor but the one it returns (its quantised rows and
    scales live in the calling thread's kept storage); a prefill-size call's rows are its own
    tensor, freed with it."""
    g = torch.Generator().manual_seed(3)
    q, s = quantize_rows(torch.randn(48, 96, generator=g))
    p = native().pack_weight(q.unsqueeze(0))
    none = torch.zeros(0, dtype=torch.long)
    for rows in (1, 2, 16):
        x = torch.randn(rows, 96, generator=g)
        native().w8a8_packed(x, p, s, none, 48)
        assert _allocations(lambda: native().w8a8_packed(x, p, s, none, 48)) == 1
    big = torch.randn(4096, 96, generator=g)       # its quantised rows (384 or 768 KB) over the kept size
    assert _allocations(lambda: native().w8a8_packed(big, p, s, none, 48)) == 2


@pytest.mark.skipif(native() is None, reason="ouro's int8 kernel is not built here")
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_rows_of_a_wider_tensor_are_read_in_place(rows):
    """x a column slice of a wider product's output (row stride over K, as the KDA's f_a half of its
    merged projection): the same bits as its contiguous copy, and no copy made."""
    g = torch.Generator().manual_seed(rows)
    q, s = quantize_rows(torch.randn(48, 96, generator=g))
    p = native().pack_weight(q.unsqueeze(0))
    none = torch.zeros(0, dtype=torch.long)
    wide = torch.randn(rows, 136, generator=g)
    x = wide[:, 24:120]
    assert x.stride() == (136, 1)
    got = native().w8a8_packed(x, p, s, none, 48)
    assert torch.equal(got, native().w8a8_packed(x.contiguous(), p, s, none, 48))
    assert torch.equal(got, w8a8_linear_naive(x.contiguous(), q, s))
    assert _allocations(lambda: native().w8a8_packed(x, p, s, none, 48)) == 1     # its output: no copy of x
