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


@pytest.mark.parametrize("path", ["native", "portable"])
@pytest.mark.parametrize("T", [1, 2, 5, 16, 64])
@pytest.mark.parametrize("E,D,I,k", [(8, 24, 16, 2), (32, 64, 40, 4), (5, 13, 7, 3), (1, 9, 5, 1)])
def test_op_equals_eager_and_reference(path, T, E, D, I, k):
    x, w, ex, gu, dn = case(T, E, D, I, k)
    ref64 = experts_naive(x.double(), w.double(), ex, gu.double(), dn.double(), 1.5)
    eager = experts_grouped(x, w, ex, gu, dn, 1.5)
    with kernels.portable("experts") if path == "portable" else torch.no_grad():
        got = fx.moe_experts(x, w, ex, gu, dn, 1.5)
    assert not got.isnan().any()
    assert rel_rms(got, eager) <= 1e-6
    assert rel_rms(got, ref64) <= 2 * rel_rms(eager, ref64) + 3e-7


def test_a_token_alone_equals_it_in_a_batch_bit_for_bit():
    x, w, ex, gu, dn = case(16, 8, 40, 24, 2)
    full = fx.moe_experts(x, w, ex, gu, dn, 7.0)
    for t in (0, 7, 15):
        alone = fx.moe_experts(x[t:t + 1], w[t:t + 1], ex[t:t + 1], gu, dn, 7.0)
        assert torch.equal(alone[0], full[t])


def test_nan_stays_with_its_token_and_bad_ids_are_refused():
    x, w, ex, gu, dn = case(4, 8, 16, 8, 2)
    x[1] = float("nan")
    out = fx.moe_experts(x, w, ex, gu, dn, 7.0)
    assert out[1].isnan().all() and not out[[0, 2, 3]].isnan().any()
    ex[0, 0] = 8
    with pytest.raises(RuntimeError, match="outside"):
        fx.moe_experts(x, w, ex, gu, dn, 7.0)


def test_the_layer_takes_the_op_for_a_few_rows_and_agrees_with_eager_only():
    from types import SimpleNamespace
    from ouro.layers.moe import Experts
    cfg = SimpleNamespace(n_routed_experts=16, hidden_size=32, moe_intermediate_size=24, swiglu_limit=7.0,
                          num_experts_per_tok=4)
    layer = Experts(cfg)
    x, w, ex, gu, dn = case(8, 16, 32, 24, 4)
    layer.gate_up_proj.data, layer.down_proj.data = gu, dn
    calls = []
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append(str(func))
            return func(*args, **(kwargs or {}))
    with Count():
        got = layer(x, w, ex)
    with kernels.eager_only():
        ref = layer(x, w, ex)
    assert any("moe_experts" in c for c in calls)
    assert rel_rms(got, ref) <= 1e-6
