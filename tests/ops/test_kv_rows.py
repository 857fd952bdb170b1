"""Quantised KV-cache rows (`ops/quant/kv_rows.py`): the byte layout against its per-group
reference, the error each kind promises, zero and outlier rows, and a row's independence from
every other row (its scales travel inside it)."""

import pytest
import torch

from ouro.ops.quant.kv_rows import KINDS, decode_rows, decode_rows_naive, encode_rows, row_bytes


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("d, group", [(512, 128), (64, 128), (130, 64), (16, 16)])
def test_rows_round_trip_within_their_precision(kind, d, group):
    g = torch.Generator().manual_seed(d + group)
    x = torch.randn(9, d, generator=g)
    x[1] = 0                                   # all-zero row
    x[2, 0] = 1e4                              # an outlier in the first group only
    enc = encode_rows(x, kind, group)
    assert enc.dtype == torch.uint8 and enc.shape == (9, row_bytes(d, group))
    dec = decode_rows(enc, d, kind, group)
    assert torch.equal(dec, decode_rows_naive(enc, d, kind, group))
    assert (dec[1] == 0).all()
    # per group: int8 error <= half a step of amax/127; e4m3 keeps 3 mantissa bits (relative 2^-4)
    for r in (0, 2, 5):
        for s in range(0, d, group):
            grp, back = x[r, s:s + group], dec[r, s:s + group]
            amax = grp.abs().max()
            bound = amax / 127 / 2 if kind == "int8" else torch.maximum(grp.abs() / 16, amax / 448 * 2 ** -9)
            assert ((back - grp).abs() <= bound + 1e-6 * amax).all(), (r, s)
    if d > group:                              # the outlier's group does not flatten the next group
        nxt = slice(group, 2 * group)
        assert ((dec[2, nxt] - x[2, nxt]).abs().max() / x[2, nxt].abs().max()) < 0.07


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_row_decodes_the_same_alone_or_among_others(kind):
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(1))
    enc = encode_rows(x, kind)
    assert torch.equal(encode_rows(x[3:4], kind)[0], enc[3])
    shuffled = enc[[5, 3, 0]]                  # rows moved (a page copied, a transfer) keep their scales
    assert torch.equal(decode_rows(shuffled, 256, kind), decode_rows(enc, 256, kind)[[5, 3, 0]])


def test_layout_sizes():
    assert row_bytes(512) == 528 and row_bytes(128) == 132 and row_bytes(130, 64) == 130 + 12
