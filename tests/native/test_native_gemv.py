"""The few-row float32 product as a native op (`ouro/native/gemv.cpp`) against float64 and F.linear,
on every path this machine runs (its vector path and the portable loops), at odd and even sizes
that are not multiples of the vector width; one fixed summation order per output (bit-identical at
1 and 2 threads, and whatever rows share the call); one call in a compiled graph; and its place in
`gemm_pick` (offered only up to GEMV_ROWS rows, chosen by measurement) and in `Linear` (F.linear
under `eager_only()`, autograd and batch-invariant mode)."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

from ouro.machine import gemm_pick
from ouro.layers.linear import Linear
from ouro.native import gemv as G
from ouro.native import kernels
from ouro.ops import batch_invariant


def rel_rms(a, b):
    return float((a.double() - b.double()).square().mean().sqrt() / b.double().square().mean().sqrt())


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        assert G.can(torch.ones(1)), kernels.why_not("gemv")
        yield


def path_of(path):
    return kernels.portable("gemv") if path == "portable" else contextlib.nullcontext()


def poisoned_gemv(x, w):
    """The op's result, with the allocator first handed a NaN-filled block of the output's size (an
    output element the kernel forgot would likely read NaN), checked to hold none."""
    poison = torch.full((x.shape[0], w.shape[0]), float("nan"))
    del poison
    out = G.gemv(x, w)
    assert out.shape == (x.shape[0], w.shape[0]) and out.is_contiguous() and out.dtype == torch.float32
    assert not out.isnan().any()
    return out


@pytest.mark.parametrize("path", ["native", "portable"])
@pytest.mark.parametrize("M", range(1, 9))
@pytest.mark.parametrize("K", [1, 7, 64, 513])
@pytest.mark.parametrize("N", [1, 5, 64, 1537])
def test_gemv_equals_linear_and_float64(path, M, K, N):
    g = torch.Generator().manual_seed(M * 10007 + K * 101 + N)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    with path_of(path):
        out = poisoned_gemv(x, w)
    ref = F.linear(x, w)
    ref64 = x.double() @ w.double().T
    assert rel_rms(out, ref) <= 1e-6
    # every element within the float32 bound of a K-term sum in any order, |error| <= K u sum|x w|
    assert ((out.double() - ref64).abs() <= K * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T)).all()
    if M * N >= 64:      # enough outputs for an RMS (one element's error is luck: F.linear's can be ~0)
        assert rel_rms(out, ref64) <= 2 * rel_rms(ref, ref64) + 2.0 ** -24


@pytest.mark.parametrize("M,K,N", [(1, 513, 1537), (4, 64, 77), (8, 7, 5), (3, 1000, 33)])
def test_portable_path_agrees_with_the_vector_path(M, K, N):
    g = torch.Generator().manual_seed(K + N)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    vec = poisoned_gemv(x, w)
    with kernels.portable("gemv"):
        assert kernels.isa("gemv") == "portable"
        port = poisoned_gemv(x, w)
    assert rel_rms(vec, port) <= 1e-6


@pytest.mark.parametrize("M,K,N", [(1, 512, 4099), (4, 513, 1537), (8, 64, 2051)])
def test_one_fixed_order_whatever_the_threads_and_the_other_rows(M, K, N):
    """Bit-identical at 1 and 2 threads (a static split over output channels, each summed by one
    thread), and each row's result the same alone as beside others (batch-invariant)."""
    g = torch.Generator().manual_seed(N)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = G.gemv(x, w)
        torch.set_num_threads(2)
        two = G.gemv(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    for m in range(M):
        assert torch.equal(G.gemv(x[m:m + 1], w), two[m:m + 1])
    assert torch.equal(G.gemv(torch.cat([x, x[:1]]), w)[:M], two)      # another row beside them


def test_edge_sizes_and_inputs():
    w = torch.randn(9, 16)
    assert G.gemv(torch.randn(0, 16), w).shape == (0, 9)
    assert G.gemv(torch.randn(3, 16), torch.randn(0, 16)).shape == (3, 0)
    assert torch.equal(G.gemv(torch.randn(2, 0), torch.randn(5, 0)), torch.zeros(2, 5))
    xt = torch.randn(16, 3).T                                          # not contiguous: copied first
    assert rel_rms(G.gemv(xt, w), F.linear(xt, w)) <= 1e-6
    nan_x = torch.randn(2, 16)
    nan_x[1, 3] = float("nan")
    out = G.gemv(nan_x, w)
    assert out[1].isnan().all() and not out[0].isnan().any()
    with pytest.raises(RuntimeError, match="float32"):
        G.gemv(torch.randn(2, 16).double(), w.double())
    with pytest.raises(RuntimeError, match="K"):
        G.gemv(torch.randn(2, 15), w)


def test_gemv_is_one_call_in_a_compiled_graph():
    x, w = torch.randn(3, 40), torch.randn(24, 40)
    f = torch.compile(lambda a, b: G.gemv(a, b) * 2.0, fullgraph=True, backend="eager")
    assert rel_rms(f(x, w), 2.0 * F.linear(x, w)) <= 1e-6


def test_gemm_pick_offers_gemv_only_up_to_its_rows(monkeypatch, tmp_path):
    """Offered for float32 CPU weights (not bf16), timed and chosen only at row counts up to
    GEMV_ROWS, even where it would time fastest everywhere; a pin keeps it to those rows too."""
    monkeypatch.delenv("OURO_GEMM_PICK", raising=False)
    monkeypatch.setenv("OURO_CACHE", str(tmp_path))
    assert "gemv" in gemm_pick.FORMS and "gemv" in gemm_pick.available_forms(torch.zeros(8, 4))
    assert "gemv" not in gemm_pick.available_forms(torch.zeros(8, 4, dtype=torch.bfloat16))
    assert [gemm_pick.offers("gemv", r) for r in (1, 8, 9, 16)] == [True, True, False, False]
    timed = []

    def fake(form, weight, rows, budget_s=0.03):
        timed.append((form, rows))
        return 0.1 if form == "gemv" else 1.0
    monkeypatch.setattr(gemm_pick, "time_form", fake)
    forms = gemm_pick.pick_forms(torch.zeros(64, 8))
    small = [r <= gemm_pick.GEMV_ROWS for r in gemm_pick.ROWS]
    assert [f == "gemv" for f in forms] == small and any(small) and not all(small)
    assert all(r <= gemm_pick.GEMV_ROWS for f, r in timed if f == "gemv")
    for rows in range(1, 600):                # wherever the measured choice is gemv, the rows are few
        assert gemm_pick.form_for(forms, rows) != "gemv" or rows <= gemm_pick.GEMV_ROWS
    monkeypatch.setenv("OURO_GEMM_PICK", "gemv")
    assert [f == "gemv" for f in gemm_pick.pick_forms(torch.zeros(64, 8))] == small
    w = torch.randn(24, 40)
    for rows in (1, 8, 9, 40):                # more rows than it takes: F.linear
        x = torch.randn(rows, 40)
        assert rel_rms(gemm_pick.product(x, w, "gemv"), F.linear(x, w)) <= 1e-6


def test_linear_runs_gemv_only_where_fused_paths_run(monkeypatch):
    """A Linear whose measured form is gemv calls it; inside `eager_only()` (the fused paths'
    reference), with autograd on, or in batch-invariant mode it runs F.linear itself."""
    calls = []
    real = G.gemv

    def counted(x, w):
        calls.append(x.shape)
        return real(x, w)
    monkeypatch.setattr(G, "gemv", counted)
    layer = Linear(40, 24, bias=False)
    layer.forms = ["gemv"] * len(gemm_pick.ROWS)
    x = torch.randn(2, 3, 40)
    out = layer(x)
    assert calls == [(6, 40)] and out.shape == (2, 3, 24)
    assert rel_rms(out, F.linear(x, layer.weight)) <= 1e-6
    with kernels.eager_only():
        assert kernels.fused_off() and torch.equal(layer(x), F.linear(x, layer.weight))
    monkeypatch.setattr(batch_invariant, "enabled", lambda: True)
    assert torch.equal(layer(x), F.linear(x, layer.weight))
    monkeypatch.setattr(batch_invariant, "enabled", lambda: False)
    with torch.enable_grad():
        layer(x).sum().backward()
    assert layer.weight.grad is not None
    layer(torch.randn(20, 40))                # beyond GEMV_ROWS rows: the measured forms' F.linear
    assert calls == [(6, 40)]


def test_its_flops_and_bytes_are_counted():
    """torch's FlopCounterMode (the bench's dispatched FLOPs) and the lab's op recorder count it as
    the matmul it is: 2 M N K FLOPs, the whole weight read once."""
    from torch.utils.flop_counter import FlopCounterMode

    from ouro.lab.redundancy.op_record import OpRecorder
    x, w = torch.randn(3, 40), torch.randn(24, 40)
    with FlopCounterMode(display=False) as counter:
        G.gemv(x, w)
    assert counter.get_total_flops() == 2 * 3 * 24 * 40
    with OpRecorder(torch.nn.Linear(1, 1)) as rec:
        G.gemv(x, w)
    op = next(o for o in rec.ops if o.op == "gemv")
    assert op.matmul_flops == op.flops == 2.0 * 3 * 24 * 40
    assert op.bytes == 4.0 * (x.numel() + w.numel() + 3 * 24)
