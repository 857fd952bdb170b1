"""Context-parallel KDA pieces: slice summaries and their chain equal one unsplit run; the TF32
emulation rounds as TF32 does; the precision modes order as they should against float64."""

import pytest
import torch

from ouro.ops.kda import kda_chunk
from ouro.ops.kda.cp import chain_states, kda_sliced, matmul, round_tf32, slice_summary

from tests.helpers.numerics import rel_rms
from tests.helpers.kda_inputs import make_inputs


@pytest.mark.parametrize("cuts", [(16, 32), (7, 30, 31), (1,), (40, 63)], ids=["aligned", "mid-chunk", "first-token", "near-end"])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero", "prefix-hit"])
def test_sliced_equals_one_run(cuts, with_state):
    B, T, H, dk, dv = 3, 64, 2, 8, 12          # several sequences, dk != dv
    q, k, v, g, beta, s0 = make_inputs(B, T, H, dk, dv, seed=sum(cuts), with_state=with_state)
    o_ref, s_ref = kda_chunk(q, k, v, g, beta, s0, 16)
    o, s = kda_sliced(q, k, v, g, beta, s0, cuts, 16)
    assert not torch.isnan(o).any()
    assert rel_rms(o, o_ref) < 1e-5 and rel_rms(s, s_ref) < 1e-5


def test_summary_maps_any_incoming_state():
    q, k, v, g, beta, _ = make_inputs(2, 37, 2, 8, 12, seed=4)
    P, Z = slice_summary(q, k, v, g, beta, 16)
    for seed in range(3):
        S_in = torch.randn(2, 2, 8, 12, generator=torch.Generator().manual_seed(seed))
        assert rel_rms(P @ S_in + Z, kda_chunk(q, k, v, g, beta, S_in, 16)[1]) < 1e-5
    assert rel_rms(Z, kda_chunk(q, k, v, g, beta, None, 16)[1]) < 1e-5


def test_chain_composes_in_order():
    gen = torch.Generator().manual_seed(0)
    P0, P1 = torch.randn(2, 4, 4, generator=gen), torch.randn(2, 4, 4, generator=gen)
    Z0, Z1, S = (torch.randn(2, 4, 3, generator=gen) for _ in range(3))
    states = chain_states([(P0, Z0), (P1, Z1)], S)
    assert len(states) == 3 and torch.equal(states[0], S)
    assert torch.allclose(states[2], P1 @ (P0 @ S + Z0) + Z1, atol=1e-5)


def test_round_tf32_keeps_ten_mantissa_bits_ties_to_even():
    one = torch.tensor([1.0])
    ulp = 2.0 ** -10
    x = torch.tensor([1.0 + ulp / 2, 1.0 + 1.5 * ulp, 1.0 + 0.49 * ulp, -(1.0 + 0.51 * ulp), float("inf"), float("nan")])
    r = round_tf32(x)
    assert r[0] == one and r[1] == 1.0 + 2 * ulp          # ties: to the even neighbour
    assert r[2] == 1.0 and r[3] == -(1.0 + ulp)
    assert torch.isinf(r[4]) and torch.isnan(r[5])
    y = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    bits = round_tf32(y).view(torch.int32)
    assert ((bits & 0x1FFF) == 0).all() and ((round_tf32(y) - y).abs() <= y.abs() * 2.0 ** -11).all()


def test_precision_modes_order_against_float64():
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(64, 64, generator=gen), torch.randn(64, 64, generator=gen)
    exact = a.double() @ b.double()
    err = {p: rel_rms(matmul(a, b, p).double(), exact) for p in ("fp32", "tf32", "tf32x3")}
    assert err["tf32"] > 50 * err["fp32"]
    assert err["tf32x3"] < 4 * err["fp32"]
    with pytest.raises(ValueError, match="precision"):
        matmul(a, b, "bf16")


def test_tf32_chain_error_is_far_above_fp32_and_tf32x3_stays_near_it():
    """Over 16 slices the tf32 chain's error (against a float64 run) is well above fp32's; tf32x3
    stays within a small factor of it."""
    B, T, H, dk, dv = 1, 512, 2, 16, 16
    q, k, v, g, beta, s0 = make_inputs(B, T, H, dk, dv, seed=9, with_state=True)
    g = g * 0.02                          # slow decay: the state carries far, so errors carry too
    o64, s64 = kda_chunk(*(t.double() for t in (q, k, v, g, beta, s0)), chunk_size=16)
    cuts = tuple(range(32, T, 32))
    err = {}
    for p in ("fp32", "tf32", "tf32x3"):
        o, s = kda_sliced(q, k, v, g, beta, s0, cuts, 16, p)
        err[p] = rel_rms(s.double(), s64)
    assert err["tf32"] > 20 * err["fp32"], err
    assert err["tf32x3"] < 4 * err["fp32"], err


def test_tf32_product_off_cuda_is_the_rounded_product_and_leaves_the_setting():
    from ouro.ops.kda.cp import tf32_product
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(8, 33, 17, generator=g), torch.randn(8, 17, 9, generator=g)
    before = torch.backends.cuda.matmul.fp32_precision
    assert torch.equal(tf32_product(a, b), round_tf32(a) @ round_tf32(b))
    assert torch.backends.cuda.matmul.fp32_precision == before
