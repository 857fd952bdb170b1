"""The op recorder reads the fused native ops (`ouro.lab.redundancy.native_cost`): each counts the rows and
slots it really reads (not the whole cache tensor it indexes into) and the products it does, so the
redundancy probe's work-against-floor finding is right on the fused decode step."""

import pytest
import torch

from ouro.lab.redundancy.op_record import OpRecorder
from ouro.native import kda, mhc, mla, router

F = 4.0   # bytes of a float32


@pytest.fixture(autouse=True)
def _inference():
    with torch.no_grad():      # the fused paths run without autograd only
        yield


def _recorded(fn, name):
    with OpRecorder(torch.nn.Linear(1, 1)) as rec:
        fn()
    return next(o for o in rec.ops if o.op == name)


def _need(module, *tensors):
    if not module.can(*tensors):
        pytest.skip(f"the fused {module.FAMILY} kernels are not built here")


def test_sparse_mla_decode_reads_the_selected_latent_rows_only():
    n, H, r, W, ps = 2, 3, 32, 8, 16
    latents = torch.randn(64 * ps, r)                   # a cache far larger than what is selected
    q = torch.randn(n, H, r)
    _need(mla, q, latents)
    tokens = torch.full((n, W), -1, dtype=torch.long)
    tokens[0, :5], tokens[1, :2] = torch.arange(5), torch.tensor([7, 30])
    table, seq = torch.arange(64).view(4, 16), torch.tensor([1, 2])
    o = _recorded(lambda: mla.sparse_mla_decode(q, latents, "", 0, tokens, table, seq, ps), "sparse_mla_decode")
    assert o.bytes == 2 * q.numel() * F + 7 * r * F + tokens.numel() * 8 + 2 * 16 * 8 + 2 * 8
    assert o.matmul_flops == o.flops == 4.0 * H * r * 7       # scores and the weighted sum of 7 rows


def test_index_select_decode_reads_the_pools_it_scores():
    n, Hi, d, ps, kpool, select_k = 2, 3, 16, 16, 4, 2
    pooled = torch.randn(64 * ps // kpool, d)
    q, w = torch.randn(n, Hi, d), torch.randn(n, Hi)
    _need(mla, q, w, pooled)
    table, seq = torch.arange(64).view(4, 16), torch.tensor([0, 3])
    positions = torch.tensor([40, 6])                   # 10 pools scored; 1 pool: kept whole, none scored
    width = select_k * kpool + kpool - 1
    o = _recorded(lambda: mla.index_select_decode(q, w, pooled, table, seq, positions, ps, select_k, kpool, 0.25,
                                                  width), "index_select_decode")
    assert o.matmul_flops == 2.0 * Hi * d * 10
    assert o.bytes == (q.numel() + w.numel() + 10 * d) * F + 2 * 16 * 8 + 2 * 8 + 2 * 8 + n * width * 8


def test_kda_decode_reads_its_slots_state_only():
    T, H, dk, dv, K, S = 2, 2, 8, 8, 4, 32
    C = H * dk
    conv, rec = torch.zeros(S, 3 * C, K - 1), torch.zeros(S, H, dk, dv)
    args = (torch.randn(T, 3 * C), torch.randn(T, C), torch.randn(T, H), torch.randn(T, C), torch.randn(3 * C, K),
            torch.zeros(C), torch.zeros(H), None, torch.ones(dv), 1e-6, conv, rec, torch.tensor([3, 9]),
            torch.tensor([True, False]))
    _need(kda, *args[:5])
    o = _recorded(lambda: kda.kda_decode(*args), "kda_decode")
    state = T * (conv[0].numel() + rec[0].numel()) * F
    assert 2 * state < o.bytes < 2 * state + 4 * 3 * C * (T + K) * F + 1024
    assert o.bytes < (conv.numel() + rec.numel()) * F                      # not the whole cache
    assert o.matmul_flops == T * (6.0 * H * dk * dv + 2.0 * 3 * C * K)


def test_router_and_hyper_connection_products_are_counted():
    T, D, E, n = 3, 16, 8, 4
    x, weight, bias = torch.randn(T, D), torch.randn(E, D), torch.zeros(E)
    _need(router, x, weight)
    o = _recorded(lambda: router.route(x, weight, bias, 2, 2, 1, True, 1.0), "route")
    assert o.matmul_flops == 2.0 * T * E * D
    streams, fn = torch.randn(T, n, D), torch.randn((2 + n) * n, n * D)
    base, scale = torch.zeros((2 + n) * n), torch.ones(3)
    _need(mhc, streams, fn)
    o = _recorded(lambda: mhc.hc_pre(streams, fn, base, scale, 1e-6, 1e-6, 20), "hc_pre")
    assert o.matmul_flops == 2.0 * T * fn.numel()
