"""Batch-invariant kernels (`ouro.ops.batch_invariant`, `--enable-deterministic-inference`): with
them on, a row's result is the same bits whether it is computed alone or inside any batch, and
still agrees with a float64 reference; with them off, torch's own kernels are back."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ouro.ops import batch_invariant
from ouro.ops.conv1d import causal_conv1d, causal_conv1d_naive
from ouro.ops.dsa.indexer import index_select
from ouro.ops.kda.chunk import kda_chunk, unit_lower_inverse
from ouro.ops.kda.naive import kda_naive
from ouro.ops.mhc.sinkhorn import sinkhorn, sinkhorn_naive
from ouro.ops.moe.experts import experts_grouped, experts_naive
from ouro.engine.options import check_engine_options

from tests.helpers.numerics import assert_close


@pytest.fixture
def invariant():
    batch_invariant.enable()
    yield batch_invariant.row_block()
    batch_invariant.disable()


def _rows_equal(f, inputs, top=40):
    """f(rows [:m] of every input) equals the first m rows of f(all rows), for every m."""
    whole = f(*inputs)
    return all(torch.equal(f(*(x[:m] for x in inputs)), whole[:m]) for m in range(1, top))


g = torch.Generator().manual_seed(0)
X = torch.randn(48, 96, generator=g)
W = torch.randn(40, 96, generator=g)
BIAS = torch.randn(40, generator=g)
PRODUCTS = {
    "mm": lambda x: x @ W.T,
    "linear_bias": lambda x: F.linear(x, W, BIAS),
    "addmm_2d_bias": lambda x: torch.addmm(x[:, :40], x, W.T, beta=0.5, alpha=2.0),
    "linear_3d": lambda x: F.linear(x.view(-1, 1, 96).expand(-1, 3, 96), W).sum(1),
    "bmm_rows": lambda x: torch.bmm(x.view(-1, 4, 24), W[:, :24].T.expand(x.shape[0], 24, 40)),
    "einsum": lambda x: torch.einsum("nk,ok->no", x, W),
}


@pytest.mark.parametrize("name", sorted(PRODUCTS))
def test_products_are_row_invariant_and_exact(invariant, name):
    f = PRODUCTS[name]
    assert _rows_equal(f, [X])
    ref = {"mm": lambda x: x.double() @ W.double().T}.get(name)
    with torch.no_grad():
        out = f(X)
    assert not torch.isnan(out).any()
    batch_invariant.disable()          # torch's own kernel is the reference for the values
    expect = f(X)
    batch_invariant.enable()
    assert_close(out, expect, 1e-6)
    if ref is not None:
        assert_close(out, ref(X).float(), 1e-6)


def test_enable_measures_a_block_and_disable_restores_torch():
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(1))
    before = x @ W.T
    torch_invariant = batch_invariant.rows_invariant(torch.mm)
    block = batch_invariant.enable()
    try:
        assert block in batch_invariant.ROW_BLOCKS and batch_invariant.enabled()
        assert set(batch_invariant.replaced()) >= {"mm", "addmm", "bmm"}
        assert batch_invariant.rows_invariant(torch.mm, block)
        assert batch_invariant.enable() == block            # idempotent
    finally:
        batch_invariant.disable()
    assert not batch_invariant.enabled() and batch_invariant.replaced() == ()
    assert torch.equal(x @ W.T, before)
    assert batch_invariant.rows_invariant(torch.mm) == torch_invariant


def test_unpadded_products_are_not_row_invariant_here():
    # the mutation: the same override without padding (block 1) is what torch does, and on this
    # machine's BLAS that changes rows with the row count; where it does not, nothing needs fixing
    if batch_invariant.rows_invariant(torch.mm):
        pytest.skip("this BLAS is row-invariant already: the padding has nothing to fix here")
    assert not batch_invariant.rows_invariant(batch_invariant._products(1)["mm"])


@pytest.mark.parametrize("name", ["sigmoid", "silu", "softplus", "tanh", "gelu"])
def test_elementwise_tails_take_the_vector_formula(invariant, name):
    op = {"sigmoid": torch.sigmoid, "silu": F.silu, "softplus": F.softplus, "tanh": torch.tanh, "gelu": F.gelu}[name]
    x = torch.randn(4096, generator=torch.Generator().manual_seed(2)) * 4
    whole = op(x)
    for n in range(1, 70):
        for start in (0, 13, 1000, 3001):
            assert torch.equal(op(x[start:start + n].clone()), whole[start:start + n])
    grid = x.view(64, 64)[:, ::3]                                   # non-contiguous input keeps its shape
    assert op(grid).shape == grid.shape and torch.equal(op(grid), op(grid.contiguous()))
    assert_close(whole, op(x.double()).float(), 1e-6)


def test_sinkhorn_rows_do_not_depend_on_the_batch(invariant):
    c = torch.softmax(torch.randn(70, 4, 4, generator=torch.Generator().manual_seed(3)) * 3, -1) + 1e-6
    assert _rows_equal(lambda t: sinkhorn(t, 20, 1e-6), [c], top=70)
    assert_close(sinkhorn(c[:3], 20, 1e-6), torch.stack([sinkhorn_naive(m, 20, 1e-6) for m in c[:3]]), 1e-6)


def test_experts_rows_do_not_depend_on_the_batch(invariant):
    gen = torch.Generator().manual_seed(4)
    T, D, I, E, k = 24, 32, 16, 8, 2
    x = torch.randn(T, D, generator=gen)
    gate_up, down = torch.randn(E, 2 * I, D, generator=gen) * 0.2, torch.randn(E, D, I, generator=gen) * 0.2
    experts = torch.rand(T, E, generator=gen).argsort(-1)[:, :k]
    weights = torch.rand(T, k, generator=gen)
    f = lambda x, w, e: experts_grouped(x, w, e, gate_up, down, 7.0)
    assert _rows_equal(f, [x, weights, experts], top=T)
    assert_close(f(x, weights, experts), experts_naive(x, weights, experts, gate_up, down, 7.0), 1e-6)


def test_conv_positions_do_not_depend_on_the_length(invariant):
    gen = torch.Generator().manual_seed(5)
    C, K, T = 24, 4, 20
    x, w, state = torch.randn(1, C, T, generator=gen), torch.randn(C, K, generator=gen), torch.randn(1, C, K - 1, generator=gen)
    full, _ = causal_conv1d(x, w, state, torch.tensor([T]))
    for t in (1, 2, 5, 8, 9, 16):
        part, _ = causal_conv1d(x[..., :t], w, state, torch.tensor([t]))
        assert torch.equal(part, full[..., :t])
    ref, _ = causal_conv1d_naive(x, w, state, torch.tensor([T]))
    assert_close(full, ref, 1e-6)


def test_kda_chunk_of_a_sequence_does_not_depend_on_its_batch(invariant):
    gen = torch.Generator().manual_seed(6)
    B, T, H, dk, dv, n = 3, 27, 2, 16, 16, 16
    q = F.normalize(torch.randn(B, T, H, dk, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, dk, generator=gen), dim=-1)
    v, g = torch.randn(B, T, H, dv, generator=gen), -torch.rand(B, T, H, dk, generator=gen) * 2
    beta = torch.rand(B, T, H, generator=gen)
    g[1, n:], beta[1, n:] = 0.0, 0.0                               # sequence 1 is n long, right-padded
    o, S = kda_chunk(q, k, v, g, beta)
    o1, S1 = kda_chunk(q[1:2, :n], k[1:2, :n], v[1:2, :n], g[1:2, :n], beta[1:2, :n])
    assert torch.equal(o[1:2, :n], o1) and torch.equal(S[1:2], S1)
    ref_o, ref_S = kda_naive(q.double(), k.double(), v.double(), g.double(), beta.double())
    assert_close(o, ref_o.float(), 1e-5)
    assert_close(S, ref_S.float(), 1e-5)


def test_unit_lower_inverse_is_the_inverse():
    gen = torch.Generator().manual_seed(7)
    lhs = torch.eye(16) + torch.randn(5, 16, 16, generator=gen).tril(-1) * 0.3
    inv = unit_lower_inverse(lhs.double())
    assert torch.allclose(lhs.double() @ inv, torch.eye(16, dtype=torch.float64).expand(5, 16, 16), atol=1e-12)
    broken = lhs.clone()
    broken[:, 5, 2] += 1.0                                          # a different matrix is not inverted by it
    assert not torch.allclose(broken.double() @ inv, torch.eye(16, dtype=torch.float64).expand(5, 16, 16), atol=1e-6)


def test_index_selection_layout_does_not_depend_on_the_pools_padded_in():
    # a query's selected tokens sit in the same columns whether its batch pads the pool keys to
    # its own context or to a longer one (the attention sums over the columns in order)
    gen = torch.Generator().manual_seed(8)
    kpool, select_k, Hi, d = 4, 4, 2, 8
    width = select_k * kpool + kpool - 1
    q, w = torch.randn(1, Hi, d, generator=gen), torch.rand(1, Hi, generator=gen)
    pooled = torch.randn(1, 12, d, generator=gen)
    pos = torch.tensor([10])                                        # 2 complete pools, 3 tail tokens
    own = index_select(q, w, pooled[:, :2], pos, select_k, kpool, 1.0, width)
    padded = index_select(q, w, pooled, pos, select_k, kpool, 1.0, width)
    assert torch.equal(own, padded)
    assert own[0, -(kpool - 1):].tolist() == [8, 9, 10]
    assert sorted(t for t in own[0].tolist() if t >= 0) == list(range(11))


def test_the_option_is_checked():
    from ouro.config import EngineConfig, ModelConfig
    from ouro.models.resolve import resolve_model
    with pytest.raises(ValueError, match="deterministic_inference must be True or False"):
        EngineConfig(deterministic_inference="yes")
    with pytest.raises(ValueError, match="drop --compile"):
        check_engine_options(EngineConfig(deterministic_inference=True, compile=True),
                             ModelConfig.from_hf(resolve_model("tiny-py")))


@pytest.mark.processes
@pytest.mark.slow
def test_the_cli_turns_it_on():
    import subprocess
    import sys
    argv = [sys.executable, "-m", "ouro.cli", "generate", "tiny-py", "--max-tokens", "6", "--ignore-eos"]
    runs = [subprocess.run(argv + extra, capture_output=True, text=True, timeout=300)
            for extra in (["--enable-deterministic-inference"], [])]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-2000:]
    assert "deterministic inference: products padded to" in runs[0].stderr
    assert "deterministic inference" not in runs[1].stderr
    assert runs[0].stdout.strip() and runs[0].stdout == runs[1].stdout      # greedy text is the same either way
