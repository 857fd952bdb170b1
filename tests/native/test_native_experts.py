"""The routed experts as one native op (`ouro/native/experts.cpp`) against the eager forms and the
one-at-a-time reference, on every path this machine runs."""

import pytest
import torch

from ouro.native import experts as fx
from ouro.native import kernels
from ouro.ops.moe import experts_grouped, experts_naive


def rel_rms(a, b):
    return float((a.double() - b.double()).square().mean().sqrt() / b.double().square().mean().sqrt())


def case(T, E, D, I, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    gu = torch.randn(E, 2 * I, D, generator=g) / D ** 0.5 * 3   # gate values past the limit too
    dn = torch.randn(E, D, I, generator=g) / I ** 0.5
    x = torch.randn(T, D, generator=g)
    ex = torch.rand(T, E, generator=g).argsort(-1)[:, :k]
    w = torch.rand(T, k, generator=g)
    return x, w, ex, gu, dn


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        assert fx.can(torch.ones(1)), kernels.why_not("experts")
        yield


@pytest.mark.parametrize("tiled", [False, True], ids=["streamed", "tiled"])
@pytest.mark.parametrize("path", ["native", "portable"])
@pytest.mark.parametrize("T", [1, 2, 5, 16, 64])
@pytest.mark.parametrize("E,D,I,k", [(8, 24, 16, 2), (32, 64, 40, 4), (5, 13, 7, 3), (1, 9, 5, 1)])
def test_op_equals_eager_and_reference(tiled, path, T, E, D, I, k):
    x, w, ex, gu, dn = case(T, E, D, I, k)
    ref64 = experts_naive(x.double(), w.double(), ex, gu.double(), dn.double(), 1.5)
    eager = experts_grouped(x, w, ex, gu, dn, 1.5)
    with kernels.portable("experts") if path == "portable" else torch.no_grad():
        got = fx.moe_experts(x, w, ex, gu, dn, 1.5, tiled)
    assert not got.isnan().any()
    assert rel_rms(got, eager) <= 1e-6
    assert rel_rms(got, ref64) <= 2 * rel_rms(eager, ref64) + 3e-7


# the tiled form's edges: K past two passes of its blocking (128 columns) in both products, an
# intermediate size that leaves a short gate/up panel, an output width that leaves a short panel,
# an expert with more rows than one task's chunk (258), a row group short of six
@pytest.mark.parametrize("T,E,D,I,k", [(7, 3, 300, 264, 2), (300, 2, 40, 24, 2), (97, 4, 513, 20, 3),
                                       (64, 32, 512, 256, 4)])
def test_tiled_form_at_its_edges_on_both_paths(T, E, D, I, k):
    x, w, ex, gu, dn = case(T, E, D, I, k, seed=3)
    ref64 = experts_naive(x.double(), w.double(), ex, gu.double(), dn.double(), 1.5)
    streamed = fx.moe_experts(x, w, ex, gu, dn, 1.5, False)
    got = fx.moe_experts(x, w, ex, gu, dn, 1.5, True)
    with kernels.portable("experts"):
        portable = fx.moe_experts(x, w, ex, gu, dn, 1.5, True)
    assert not got.isnan().any() and not portable.isnan().any()
    for form in (got, portable):
        assert rel_rms(form, ref64) <= 2 * rel_rms(streamed, ref64) + 3e-7
    assert rel_rms(got, portable) <= 1e-6


@pytest.mark.parametrize("tiled", [False, True], ids=["streamed", "tiled"])
def test_a_token_alone_equals_it_in_a_batch_bit_for_bit(tiled):
    x, w, ex, gu, dn = case(40, 8, 40, 24, 2)
    full = fx.moe_experts(x, w, ex, gu, dn, 7.0, tiled)
    for t in (0, 7, 15, 39):
        alone = fx.moe_experts(x[t:t + 1], w[t:t + 1], ex[t:t + 1], gu, dn, 7.0, tiled)
        assert torch.equal(alone[0], full[t])


@pytest.mark.parametrize("tiled", [False, True], ids=["streamed", "tiled"])
def test_nan_stays_with_its_token_and_bad_ids_are_refused(tiled):
    x, w, ex, gu, dn = case(4, 8, 16, 8, 2)
    x[1] = float("nan")
    out = fx.moe_experts(x, w, ex, gu, dn, 7.0, tiled)
    assert out[1].isnan().all() and not out[[0, 2, 3]].isnan().any()
    ex[0, 0] = 8
    with pytest.raises(RuntimeError, match="outside"):
        fx.moe_experts(x, w, ex, gu, dn, 7.0, tiled)


@pytest.mark.parametrize("T,deterministic,form", [(8, False, False), (128, False, True), (128, True, False)])
def test_the_layer_takes_the_op_in_the_form_for_its_rows_and_agrees_with_eager_only(monkeypatch, T, deterministic, form):
    """Streamed for a few rows an expert, tiled from TILED_ROWS_PER_EXPERT (128 x 4 / 16 = 32 here),
    streamed at any count under deterministic inference."""
    from types import SimpleNamespace
    from ouro.layers.moe import Experts
    from ouro.ops import batch_invariant
    cfg = SimpleNamespace(n_routed_experts=16, hidden_size=32, moe_intermediate_size=24, swiglu_limit=7.0,
                          num_experts_per_tok=4)
    layer = Experts(cfg)
    x, w, ex, gu, dn = case(T, 16, 32, 24, 4)
    layer.gate_up_proj.data, layer.down_proj.data = gu, dn
    forms, op = [], fx.moe_experts
    monkeypatch.setattr(fx, "moe_experts", lambda *a: forms.append(a[-1]) or op(*a))
    monkeypatch.setattr(batch_invariant, "enabled", lambda: deterministic)
    got = layer(x, w, ex)
    with kernels.eager_only():
        ref = layer(x, w, ex)
    assert forms == [form]
    assert rel_rms(got, ref) <= 1e-6


@pytest.mark.parametrize("tiled", [False, True], ids=["streamed", "tiled"])
def test_channel_shards_add_up_to_the_whole(tiled):
    """Tensor parallelism splits every expert's intermediate channels across ranks and sums the
    ranks' outputs (`parallel/tp_shard.py`); each shard runs the op on its own slice (here taken as
    non-contiguous views of the full weights) and the shards' sum is the whole op's result."""
    T, E, D, I, k = 96, 4, 48, 40, 2
    x, w, ex, gu, dn = case(T, E, D, I, k, seed=5)
    whole = fx.moe_experts(x, w, ex, gu, dn, 1.5, tiled)
    parts = []
    for r in range(2):
        s = slice(r * I // 2, (r + 1) * I // 2)
        gu_r = torch.cat([gu[:, s], gu[:, I:][:, s]], 1)
        parts.append(fx.moe_experts(x, w, ex, gu_r, dn[:, :, s], 1.5, tiled))
    assert fx.tiled_for(ex, E) or not tiled
    assert rel_rms(parts[0] + parts[1], whole) <= 1e-6
