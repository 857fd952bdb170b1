"""ouro's two native float32 product forms against F.linear and float64, on every path this machine
runs (its vector path and the portable loops): `gemv` (`ouro/native/gemv.cpp`, a few rows, the
weight streamed once for all of them) and `panels` (`ouro/native/panels.cpp`, a decode step's rows on
a copy of the weight packed into column panels), at odd and even sizes that are not multiples of a
vector, a tile or a panel; one fixed summation order per output (bit-identical at 1 and 2 threads, and
whatever rows share the call); one call in a compiled graph; their place in `gemm_pick` (offered only
up to their rows, chosen by measurement, refused where wrong) and in `Linear` (F.linear under
`eager_only()`, autograd and batch-invariant mode). Then what is each form's own: the panels' every
path giving the same bits, their blocks of many rows and their cache of packed copies."""

import contextlib
import gc

import pytest
import torch
import torch.nn.functional as F

from ouro.layers.linear import Linear
from ouro.machine import gemm_pick, model_forms
from ouro.native import gemv as G
from ouro.native import kernels
from ouro.native import panels as P
from ouro.ops import batch_invariant

# form -> (its module, the op's name on it, the rows it is offered up to)
FORMS = {"gemv": (G, "gemv", gemm_pick.GEMV_ROWS), "panels": (P, "panel_linear", gemm_pick.PANEL_ROWS)}
ROWS = {"gemv": list(range(1, 9)), "panels": [1, 3, 6, 7, 8, 9, 13, 16, 23, 64]}


def rel_rms(a, b):
    return float((a.double() - b.double()).square().mean().sqrt() / b.double().square().mean().sqrt())


def op(form):
    module, name, _ = FORMS[form]
    return getattr(module, name)


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        for form, (module, _, _) in FORMS.items():
            assert module.can(torch.ones(1)), kernels.why_not(form)
        yield


def path_of(form, path):
    return kernels.portable(form) if path == "portable" else contextlib.nullcontext()


def poisoned(form, x, w):
    """The op's result, with the allocator first handed a NaN-filled block of the output's size (an
    output element the kernel forgot would likely read NaN), checked to hold none."""
    poison = torch.full((x.shape[0], w.shape[0]), float("nan"))
    del poison
    out = op(form)(x, w)
    assert out.shape == (x.shape[0], w.shape[0]) and out.is_contiguous() and out.dtype == torch.float32
    assert not out.isnan().any()
    return out


@pytest.mark.parametrize("path", ["native", "portable"])
@pytest.mark.parametrize("form,M", [(f, m) for f in FORMS for m in ROWS[f]])
@pytest.mark.parametrize("K", [1, 7, 64, 513])
@pytest.mark.parametrize("N", [1, 5, 33, 64, 1537])
def test_equals_linear_and_float64(form, path, M, K, N):
    g = torch.Generator().manual_seed(M * 10007 + K * 101 + N)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    with path_of(form, path):
        out = poisoned(form, x, w)
    ref = F.linear(x, w)
    ref64 = x.double() @ w.double().T
    assert rel_rms(out, ref) <= 1e-6
    # every element within the float32 bound of a K-term sum in any order, |error| <= K u sum|x w|
    assert ((out.double() - ref64).abs() <= K * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T)).all()
    if M * N >= 64:      # enough outputs for an RMS (one element's error is luck: F.linear's can be ~0)
        assert rel_rms(out, ref64) <= 2 * rel_rms(ref, ref64) + 2.0 ** -24


@pytest.mark.parametrize("form,M,K,N", [("gemv", 1, 512, 4099), ("gemv", 4, 513, 1537), ("gemv", 8, 64, 2051),
                                        ("panels", 1, 512, 4099), ("panels", 16, 513, 1537), ("panels", 23, 64, 2051)])
def test_one_fixed_order_whatever_the_threads_and_the_other_rows(form, M, K, N):
    """Bit-identical at 1 and 2 threads (a static split over output channels, each summed by one
    thread), and each row's result the same alone as beside others (batch-invariant)."""
    f = op(form)
    g = torch.Generator().manual_seed(N)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = f(x, w)
        torch.set_num_threads(2)
        two = f(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    for m in range(M):
        assert torch.equal(f(x[m:m + 1], w), two[m:m + 1])
    assert torch.equal(f(torch.cat([x, x[:1]]), w)[:M], two)      # another row beside them


@pytest.mark.parametrize("form", FORMS)
def test_edge_sizes_and_inputs(form):
    f = op(form)
    w = torch.randn(9, 16)
    assert f(torch.randn(0, 16), w).shape == (0, 9)
    assert f(torch.randn(3, 16), torch.randn(0, 16)).shape == (3, 0)
    assert torch.equal(f(torch.randn(2, 0), torch.randn(5, 0)), torch.zeros(2, 5))
    wide = torch.randn(5, 40)
    rows = wide[:, 3:19]                                               # rows of a wider tensor
    assert torch.equal(f(rows, w), f(rows.contiguous(), w))
    xt = torch.randn(16, 3).T                                          # not contiguous: copied first
    assert torch.equal(f(xt, w), f(xt.contiguous(), w))
    nan_x = torch.randn(2, 16)
    nan_x[1, 3] = float("nan")
    out = f(nan_x, w)
    assert out[1].isnan().all() and not out[0].isnan().any()
    with pytest.raises(RuntimeError, match="float32"):
        f(torch.randn(2, 16).double(), w.double())
    with pytest.raises(RuntimeError, match="K"):
        f(torch.randn(2, 15), w)


@pytest.mark.parametrize("form", FORMS)
def test_one_call_in_a_compiled_graph(form):
    f = op(form)
    x, w = torch.randn(3, 40), torch.randn(70, 40)
    compiled = torch.compile(lambda a, b: f(a, b) * 2.0, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x, w), 2.0 * f(x, w))


@pytest.mark.parametrize("form", FORMS)
def test_gemm_pick_offers_it_only_up_to_its_rows(form, monkeypatch, tmp_path):
    """Offered for float32 CPU weights (not bf16), timed and chosen only at row counts up to its
    rows, even where it would time fastest everywhere; a pin keeps it to those rows too; more rows
    run F.linear."""
    monkeypatch.delenv("OURO_GEMM_PICK", raising=False)
    monkeypatch.setenv("OURO_CACHE", str(tmp_path))
    most = FORMS[form][2]
    assert form in gemm_pick.FORMS and form in gemm_pick.available_forms(torch.zeros(8, 4))
    assert form not in gemm_pick.available_forms(torch.zeros(8, 4, dtype=torch.bfloat16))
    assert [gemm_pick.offers(form, r) for r in (1, most, most + 1)] == [True, True, False]
    timed = []

    def fake(f, weight, rows, budget_s=0.03):
        timed.append((f, rows))
        return 0.1 if f == form else 1.0
    monkeypatch.setattr(gemm_pick, "time_form", fake)
    forms = gemm_pick.pick_forms(torch.zeros(64, 8))
    small = [r <= most for r in gemm_pick.ROWS]
    assert [f == form for f in forms] == small and any(small) and not all(small)
    assert all(r <= most for f, r in timed if f == form)
    for rows in range(1, 600):                # wherever the measured choice is this form, the rows are few
        assert gemm_pick.form_for(forms, rows) != form or rows <= most
    monkeypatch.setenv("OURO_GEMM_PICK", form)
    assert [f == form for f in gemm_pick.pick_forms(torch.zeros(64, 8))] == small
    w = torch.randn(24, 40)
    for rows in (1, most, most + 1, 70):
        x = torch.randn(rows, 40)
        assert rel_rms(gemm_pick.product(x, w, form), F.linear(x, w)) <= 1e-6


@pytest.mark.parametrize("form", FORMS)
def test_linear_runs_it_only_where_fused_paths_run(form, monkeypatch):
    """A Linear whose measured form is this one calls it; inside `eager_only()` (the fused paths'
    reference), with autograd on, or in batch-invariant mode it runs F.linear itself."""
    module, name, most = FORMS[form]
    calls = []
    real = getattr(module, name)

    def counted(x, w):
        calls.append(x.shape)
        return real(x, w)
    monkeypatch.setattr(module, name, counted)
    layer = Linear(40, 24, bias=False)
    layer.forms = [form] * len(gemm_pick.ROWS)
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
    layer(torch.randn(most + 1, 40))          # beyond its rows: the measured forms' F.linear
    assert calls == [(6, 40)]


@pytest.mark.parametrize("form", FORMS)
def test_its_flops_and_bytes_are_counted(form):
    """torch's FlopCounterMode (the bench's dispatched FLOPs) and the lab's op recorder count it as
    the matmul it is: 2 M N K FLOPs, the whole weight read once."""
    from torch.utils.flop_counter import FlopCounterMode

    from ouro.lab.redundancy.op_record import OpRecorder
    f, name = op(form), FORMS[form][1]
    x, w = torch.randn(3, 40), torch.randn(24, 40)
    with FlopCounterMode(display=False) as counter:
        f(x, w)
    assert counter.get_total_flops() == 2 * 3 * 24 * 40
    with OpRecorder(torch.nn.Linear(1, 1)) as rec:
        f(x, w)
    rec_op = next(o for o in rec.ops if o.op == name)
    assert rec_op.matmul_flops == rec_op.flops == 2.0 * 3 * 24 * 40
    assert rec_op.bytes == 4.0 * (x.numel() + w.numel() + 3 * 24)


@pytest.mark.parametrize("form,M,K,N", [("gemv", 1, 513, 1537), ("gemv", 4, 64, 77), ("gemv", 8, 7, 5), ("gemv", 3, 1000, 33),
                                        ("panels", 1, 513, 1537), ("panels", 9, 64, 77), ("panels", 16, 512, 100),
                                        ("panels", 64, 7, 33), ("panels", 13, 1000, 65)])
def test_the_portable_path_against_the_vector_path(form, M, K, N):
    """gemv's lanes sum in another order than its portable loop (agreeing to float32 rounding); the
    panels' are chains of fused multiply-adds in order of k on every path, the vector lanes and the
    portable loop's std::fma chain the same arithmetic: the same bits."""
    g = torch.Generator().manual_seed(K + N)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    vec = poisoned(form, x, w)
    with kernels.portable(form):
        assert kernels.isa(form) == "portable"
        port = poisoned(form, x, w)
    assert torch.equal(vec, port) if form == "panels" else rel_rms(vec, port) <= 1e-6


# the panels' own


@pytest.mark.parametrize("path", ["native", "portable"])
@pytest.mark.parametrize("M,K", [(64, 2049), (200, 513), (131, 4096)])
def test_panels_in_blocks_of_many_rows(path, M, K):
    """Past a block's rows (256 KB of them: 24 rows at K = 2049, 120 at 513, 16 at 4096) the rows run
    block by block, every panel passing each: each row's result the one it has alone; at K = 4096 the
    chunked sums keep float32's error of a short sum."""
    g = torch.Generator().manual_seed(M + K)
    x, w = torch.randn(M, K, generator=g), torch.randn(37, K, generator=g)
    with path_of("panels", path):
        out = poisoned("panels", x, w)
        ref, ref64 = F.linear(x, w), x.double() @ w.double().T
        assert rel_rms(out, ref) <= 1e-6 and rel_rms(out, ref64) <= 2 * rel_rms(ref, ref64) + 2.0 ** -24
        for m in (0, M // 2, M - 1):
            assert torch.equal(P.panel_linear(x[m:m + 1], w), out[m:m + 1])


def test_the_packed_copy_follows_the_weight():
    """An in-place change of the weight is seen (its version moves); freed weights leave the cache; a
    strided weight is packed for the call, not cached; `panel_weight` is the copy the op reads, in
    panels of [k][width] with the missing columns zero."""
    w = torch.randn(48, 32)
    x = torch.randn(5, 32)
    before = P.panel_linear(x, w)
    w.mul_(-2.0)
    assert torch.equal(P.panel_linear(x, w), -2.0 * before)
    gc.collect()
    base = torch.ops.ouro_native.panel_cache_size()
    for _ in range(20):             # each weight freed before the next is packed
        t = torch.randn(64, 32)
        P.panel_linear(torch.randn(2, 32), t)
        del t
        gc.collect()
    assert torch.ops.ouro_native.panel_cache_size() <= base + 1
    packed = P.panel_weight(w)
    assert packed.data_ptr() == P.panel_weight(w).data_ptr()           # one copy a weight
    n_panels, k, width = packed.shape
    assert k == 32 and n_panels == -(-48 // width)
    flat = packed.permute(0, 2, 1).reshape(n_panels * width, k)
    assert torch.equal(flat[:48], w) and not flat[48:].any()
    size = torch.ops.ouro_native.panel_cache_size()
    wt = torch.randn(32, 48).T
    assert torch.equal(P.panel_linear(x, wt), P.panel_linear(x, wt.contiguous()))
    assert torch.ops.ouro_native.panel_cache_size() <= size + 1       # the contiguous copy's, not the view's


def test_prepack_makes_the_panels_at_load(monkeypatch):
    """`apply_to` packs a module whose forms include panels when it sets them, not in its first request."""
    packed = []
    real = P.panel_weight
    monkeypatch.setattr(P, "panel_weight", lambda w: packed.append(w.data_ptr()) or real(w))
    fresh = Linear(40, 56, bias=False)
    fresh.forms = ["gemv", "panels", "panels", "panels", "packed"]
    model_forms.prepack(fresh)
    assert packed == [fresh.weight.data_ptr()]
    fresh.forms = ["gemv"] * len(gemm_pick.ROWS)
    model_forms.prepack(fresh)
    assert len(packed) == 1


def test_a_panels_kernel_that_botches_a_second_tile_chunk_or_panel_is_not_offered(monkeypatch):
    """The form is checked against a float64 product before it is offered, on enough rows, terms and
    columns to cross a tile, a chunk of the sums and a panel: a kernel wrong only past its first 8 rows,
    64 terms or 32 columns is refused."""
    real = P.panel_linear
    for broken in (lambda x, w: torch.cat([real(x[:8], w), real(x[8:], w) * 1.01]),
                   lambda x, w: real(x[:, :64], w[:, :64]) if x.shape[1] > 64 else real(x, w),
                   lambda x, w: torch.cat([real(x, w)[:, :32], real(x, w)[:, 32:] + 1e-3], dim=1)):
        monkeypatch.setattr(P, "panel_linear", broken)
        monkeypatch.setattr(gemm_pick, "_RUNS", {})
        assert "wrong result" in gemm_pick.form_runs("panels", torch.float32)
        assert "panels" not in gemm_pick.available_forms(torch.zeros(8, 4))
    monkeypatch.setattr(P, "panel_linear", real)
    monkeypatch.setattr(gemm_pick, "_RUNS", {})
    assert gemm_pick.form_runs("panels", torch.float32) is None
