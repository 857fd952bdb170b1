"""A projection's product three ways (F.linear, transposed, oneDNN-packed): the same outputs; the
choice per row count by measurement, cached per machine and shape; the pin; the packed copy
follows in-place weight changes; an engine built here uses the measured forms on every projection."""

import json

import pytest
import torch

from ouro.machine import gemm_pick, model_forms
from ouro.layers.linear import Linear

# the forms this machine runs, asked the way the code asks (no test assumes a CPU feature)
FORMS = list(gemm_pick.available_forms(torch.zeros(2, 2)))
BF16_FORMS = list(gemm_pick.available_forms(torch.zeros(2, 2, dtype=torch.bfloat16)))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shape", [(48, 300), (512, 64), (7, 5)])
def test_every_form_gives_the_linear_result_at_every_row_count(form, shape):
    torch.manual_seed(0)
    layer = Linear(*shape, bias=False)
    torch.nn.init.normal_(layer.weight)
    layer.forms = [form] * len(gemm_pick.ROWS)
    with torch.no_grad():
        for lead in ((1,), (2,), (4,), (7,), (16,), (33,), (600,), (3, 5)):
            x = torch.randn(*lead, shape[0])
            ref = x @ layer.weight.T
            out = layer(x)
            assert out.shape == (*lead, shape[1]) and out.is_contiguous()
            err = ((out - ref).norm() / ref.norm()).item()
            assert err < 1e-6, (lead, form, err)
        assert layer(torch.randn(0, shape[0])).shape == (0, shape[1])


@pytest.mark.parametrize("form", BF16_FORMS)
def test_every_form_offered_for_bfloat16_runs_here(form):
    """On a CPU whose oneDNN cannot take bf16 (AVX2 only) `packed` is not offered for bf16 weights;
    what is offered runs and rounds like bf16 against a float64 product."""
    torch.manual_seed(0)
    layer = Linear(64, 40, bias=False).to(torch.bfloat16)
    layer.forms = [form] * len(gemm_pick.ROWS)
    with torch.no_grad():
        for rows in (1, 5, 33):
            x = torch.randn(rows, 64).to(torch.bfloat16)
            ref = x.double() @ layer.weight.double().T
            err = ((layer(x).double() - ref).norm() / ref.norm()).item()
            assert err < 2e-2, (form, rows, err)


def test_a_form_that_raises_here_is_not_offered_and_a_pin_falls_back(monkeypatch):
    """A torch build can carry a kernel this CPU cannot run: oneDNN's bf16 reorder raises on an
    AVX2-only CPU. The form is probed before it is offered, the reason is kept, nothing raises."""
    def refuse(weight):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw")
    from ouro.native import onednn
    monkeypatch.setattr(gemm_pick, "_RUNS", {})
    monkeypatch.setattr(gemm_pick, "pack", refuse)
    # native's op packs the same way, inside: the same refusal reaches the probe from there
    monkeypatch.setattr(onednn, "packed_linear", lambda x, w: refuse(w))
    w = torch.zeros(8, 4)
    assert "packed" not in gemm_pick.available_forms(w) and not gemm_pick.packable(w)
    assert "avx512bw" in gemm_pick.form_runs("packed", torch.float32)
    monkeypatch.setenv("OURO_GEMM_PICK", "packed")
    assert gemm_pick.pick_forms(w) == ["linear"] * len(gemm_pick.ROWS)


def test_a_form_that_computes_wrongly_here_is_not_offered(monkeypatch):
    real = gemm_pick.product

    def off(x, weight, form, packed=None):
        out = real(x, weight, form, packed)
        return out * 1.01 if form == "transposed" else out     # a kernel that runs but miscomputes
    monkeypatch.setattr(gemm_pick, "_RUNS", {})
    monkeypatch.setattr(gemm_pick, "product", off)
    assert "wrong result" in gemm_pick.form_runs("transposed", torch.float32)
    assert "transposed" not in gemm_pick.available_forms(torch.zeros(8, 4))
    assert gemm_pick.form_runs("linear", torch.float32) is None


def test_a_gemv_that_gives_every_row_the_first_rows_product_is_not_offered(monkeypatch):
    """The native few-row product checked as every form is: a kernel mixing up its rows (the bug a
    planted C++ fault would be) is refused before any layer runs it."""
    if "gemv" not in gemm_pick.available_forms(torch.zeros(8, 4)):
        pytest.skip("the gemv kernel is not built here")
    real = gemm_pick.product

    def first_row(x, weight, form, packed=None):
        out = real(x, weight, form, packed)
        return out[:1].expand_as(out).contiguous() if form == "gemv" else out
    monkeypatch.setattr(gemm_pick, "_RUNS", {})
    monkeypatch.setattr(gemm_pick, "product", first_row)
    assert "wrong result" in gemm_pick.form_runs("gemv", torch.float32)
    assert "gemv" not in gemm_pick.available_forms(torch.zeros(8, 4))


@pytest.mark.parametrize("fault", ["tail_rows_zero", "first_row_everywhere"])
def test_a_wrong_native_packed_product_is_not_offered(monkeypatch, fault):
    """native's `packed_linear` is how layers run the packed form, and it is checked as every form is,
    past oneDNN's exact row counts too: an op that drops its padded call's last rows, or gives every row
    the first row's product (the bugs a planted C++ fault would be), is refused before any layer runs it."""
    from ouro.native import onednn
    if not onednn.ready(torch.zeros(4, 4)):
        pytest.skip("the native packed product is not built here")
    real = onednn.packed_linear

    def wrong(x, w):
        out = real(x, w).clone()
        if fault == "tail_rows_zero":
            out[gemm_pick.EXACT_ROWS:] = 0
        else:
            out[:] = out[:1]
        return out
    monkeypatch.setattr(gemm_pick, "_RUNS", {})
    monkeypatch.setattr(onednn, "packed_linear", wrong)
    assert "wrong result" in gemm_pick.form_runs("packed", torch.float32)
    assert "packed" not in gemm_pick.available_forms(torch.zeros(8, 4))


def test_packed_copy_follows_in_place_weight_changes():
    if "packed" not in FORMS:
        pytest.skip("this torch has no oneDNN")
    layer = Linear(16, 8, bias=False)
    layer.forms = ["packed"] * len(gemm_pick.ROWS)
    x = torch.randn(4, 16)
    with torch.no_grad():
        first = layer(x)
        layer.weight.mul_(2.0)                 # a reload or an edit in place: the packed copy is stale
        assert torch.allclose(layer(x), 2 * first, rtol=1e-5, atol=1e-6)
        layer.weight.copy_(torch.randn(8, 16))
        assert torch.allclose(layer(x), x @ layer.weight.T, rtol=1e-5, atol=1e-5)


def test_autograd_and_bias_take_plain_linear():
    layer = Linear(6, 3, bias=True)
    layer.forms = ["transposed"] * len(gemm_pick.ROWS)
    x = torch.randn(2, 6)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    layer = Linear(6, 3, bias=False)
    layer.forms = ["transposed"] * len(gemm_pick.ROWS)
    layer(x).sum().backward()                   # grad enabled: nn.Linear's own product, differentiable
    assert layer.weight.grad is not None


@pytest.mark.parametrize("rows, want", [(0, "linear"), (1, "linear"), (2, "linear"), (3, "transposed"),
                                        (4, "transposed"), (8, "transposed"), (9, "packed"), (16, "packed"),
                                        (32, "packed"), (33, "linear"), (64, "linear"), (181, "linear"),
                                        (182, "packed"), (256, "packed"), (512, "packed"), (9000, "packed")])
def test_form_follows_the_nearest_measured_row_count_in_log_scale(rows, want):
    assert gemm_pick.form_for(["linear", "transposed", "packed", "linear", "packed"], rows) == want


def test_rule_takes_the_fastest_that_clearly_beats_linear():
    times = {"linear": [1.0, 2.0, 3.0], "transposed": [0.5, 1.9, 3.5], "packed": [0.6, 1.0, 2.9]}
    assert gemm_pick.choose(times) == ["transposed", "packed", "linear"]


def test_a_slow_round_does_not_decide(monkeypatch, tmp_path):
    """The best round counts: a form slowed in one round (a burst of load) still wins if it is faster."""
    monkeypatch.delenv("OURO_GEMM_PICK", raising=False)
    monkeypatch.setenv("OURO_CACHE", str(tmp_path))
    monkeypatch.setattr(gemm_pick, "packable", lambda w: True)
    seen = {}

    def fake(form, weight, rows, budget_s=0.03):
        seen[(form, rows)] = seen.get((form, rows), 0) + 1
        if form == "packed":
            return 5.0 if seen[(form, rows)] == 1 else 1.0     # slow in the first round only
        return 2.0
    monkeypatch.setattr(gemm_pick, "time_form", fake)
    assert gemm_pick.pick_forms(torch.zeros(64, 8)) == ["packed"] * len(gemm_pick.ROWS)


def test_measured_once_per_shape_and_pinned(monkeypatch, tmp_path):
    monkeypatch.delenv("OURO_GEMM_PICK", raising=False)
    monkeypatch.setenv("OURO_CACHE", str(tmp_path))
    monkeypatch.setenv("OURO_BUSY_LIMIT", "1")
    monkeypatch.setattr(gemm_pick, "packable", lambda w: True)
    monkeypatch.setattr(gemm_pick, "gemv_runs", lambda w: False)     # three forms, at every row count
    monkeypatch.setattr(gemm_pick, "panels_runs", lambda w: False)
    calls = []

    def fake(form, weight, rows, budget_s=0.03):
        calls.append((form, rows))
        return {"linear": 2.0, "transposed": 1.0, "packed": 1.5}[form] if rows > 1 else 1.0
    monkeypatch.setattr(gemm_pick, "time_form", fake)
    w = torch.zeros(64, 8)
    n = len(gemm_pick.ROWS)
    want = ["linear"] + ["transposed"] * (n - 1)
    R = gemm_pick.ROUNDS
    assert gemm_pick.pick_forms(w) == want
    assert len(calls) == 3 * n * R
    # interleaved: every form at a row count before the next row count, and the rounds repeat
    assert {f for f, _ in calls[:3]} == {"linear", "transposed", "packed"} and {r for _, r in calls[:3]} == {1}
    assert calls[:3 * n] == calls[3 * n: 6 * n]
    assert gemm_pick.pick_forms(w) == want and len(calls) == 3 * n * R   # cached
    gemm_pick.pick_forms(torch.zeros(65, 8))                           # another shape: measured
    assert len(calls) == 6 * n * R
    saved = json.loads((tmp_path / "gemm_pick.json").read_text())
    assert len(saved) == 2 and all(len(v["forms"]) == n and v["format"] == gemm_pick.FORMAT for v in saved.values())
    monkeypatch.setenv("OURO_GEMM_PICK", "transposed")
    assert gemm_pick.pick_forms(w) == ["transposed"] * n
    monkeypatch.setenv("OURO_GEMM_PICK", "sideways")
    with pytest.raises(ValueError, match="OURO_GEMM_PICK"):
        gemm_pick.pick_forms(w)


def test_a_pick_is_timed_again_when_a_native_form_is_rebuilt(monkeypatch, tmp_path):
    """Picks are keyed by the builds of the native forms they timed (gemv, the packed op): a pick
    kept from an older, slower gemv chose F.linear for [320, 512] at one row at a quarter of gemv's
    speed, and nothing timed it again."""
    monkeypatch.delenv("OURO_GEMM_PICK", raising=False)
    monkeypatch.setenv("OURO_CACHE", str(tmp_path))
    monkeypatch.setenv("OURO_BUSY_LIMIT", "1")
    monkeypatch.setattr(gemm_pick, "packable", lambda w: True)
    monkeypatch.setattr(gemm_pick, "gemv_runs", lambda w: True)
    monkeypatch.setattr(gemm_pick, "panels_runs", lambda w: False)
    real = gemm_pick.native_kernels.build_id
    assert real("gemv") != real("onednn") and real("gemv") == real("gemv") and real("no_such_family") == "no source"
    builds = {"gemv": "old", "onednn": "same"}
    monkeypatch.setattr(gemm_pick.native_kernels, "build_id", lambda family: builds[family])
    speed = {"linear": 1.0, "transposed": 2.0, "packed": 2.0, "gemv": 2.0}
    monkeypatch.setattr(gemm_pick, "time_form", lambda form, weight, rows, budget_s=0.03: speed[form])
    w = torch.zeros(64, 8)
    assert gemm_pick.pick_forms(w)[0] == "linear"
    speed["gemv"] = 0.1                                # the same build: the cached pick stands
    assert gemm_pick.pick_forms(w)[0] == "linear"
    builds["gemv"] = "new"                             # rebuilt: timed again
    assert gemm_pick.pick_forms(w)[0] == "gemv"
    speed["packed"] = 0.01
    builds["onednn"] = "other"                         # the packed op rebuilt
    assert gemm_pick.pick_forms(w)[0] == "packed"


def test_merged_projections_are_picked_with_the_model_not_in_its_first_forward(monkeypatch, tmp_path):
    """A layer's projections merged on first use (`MERGED`: q/k/v, KDA's f_a/g_a/b, MLA's q_a with kv_a,
    gate/up) have their merged shape picked by `apply_to`, with every other: the first forward times
    nothing (it did: the first request's prefill ran the merged weights' timing, and the redundancy
    probe flagged it on a fresh cache)."""
    monkeypatch.delenv("OURO_GEMM_PICK", raising=False)
    monkeypatch.setenv("OURO_CACHE", str(tmp_path))
    monkeypatch.setenv("OURO_BUSY_LIMIT", "1")
    timed = []

    def fake(form, weight, rows, budget_s=0.03):
        timed.append(tuple(weight.shape))
        return {"linear": 1.0}.get(form, 2.0)
    monkeypatch.setattr(gemm_pick, "time_form", fake)
    from ouro.layers.merged import merged_module
    from ouro.models.loader import load_model
    from ouro.models.resolve import resolve_model
    model = load_model(resolve_model("tiny"))
    model_forms.apply_to(model)
    groups = [[getattr(m, n) for n in group] for m in model.modules() for group in getattr(m, "MERGED", ())]
    assert len(groups) >= 3 and all(isinstance(p, Linear) for g in groups for p in g)
    before = len(timed)
    with torch.inference_mode():
        for g in groups:
            merged = merged_module(g)
            assert merged is not None and merged.forms is not None
    assert len(timed) == before, sorted(set(timed[before:]))


def test_pinned_packed_falls_back_where_onednn_cannot_run(monkeypatch):
    monkeypatch.setenv("OURO_GEMM_PICK", "packed")
    monkeypatch.setattr(gemm_pick, "packable", lambda w: False)
    assert gemm_pick.pick_forms(torch.zeros(4, 4)) == ["linear"] * len(gemm_pick.ROWS)


@pytest.mark.slow     # 21 s: measures every shape from an empty cache; the picking itself is tested above
def test_engine_takes_the_measured_forms_on_every_projection(monkeypatch, tmp_path):
    monkeypatch.delenv("OURO_GEMM_PICK", raising=False)
    monkeypatch.setenv("OURO_CACHE", str(tmp_path))
    monkeypatch.setenv("OURO_BUSY_LIMIT", "1")      # kept though the suite runs beside it: read back below
    from ouro.engine.llm import LLM
    from ouro.models.resolve import resolve_model
    llm = LLM(str(resolve_model("tiny")), max_memory=8 << 20)
    layers = [m for m in llm.engine.model.modules() if isinstance(m, Linear)]
    assert len(layers) > 20 and llm.engine.model.lm_head in layers
    for m in layers:
        assert m.forms == gemm_pick.pick_forms(m.weight) and set(m.forms) <= set(gemm_pick.FORMS)


def test_timing_streams_more_than_a_cache_of_weights():
    # one hot copy would time a cache read, not the stream from memory a model step does
    assert gemm_pick.stream_copies(torch.zeros(512, 512)) * 512 * 512 * 4 == gemm_pick.STREAM_BYTES
    # a small weight's copies must outgrow a last-level cache too (32 MB on a Zen 4 chiplet): with 64
    # copies a [136, 512] weight's stayed in it and F.linear's one thread won at one row, not gemv
    small = torch.zeros(136, 512)
    assert gemm_pick.stream_copies(small) * small.numel() * 4 > 32 << 20
    # past a few rows the product is compute-bound: fewer copies, a shorter first start
    assert gemm_pick.stream_copies(small, rows=64) == gemm_pick.COMPUTE_BOUND_COPIES < gemm_pick.stream_copies(small)
    assert gemm_pick.stream_copies(torch.zeros(32000, 512)) == 1
    mid = torch.zeros(2048, 2048)                      # 16 MiB: four copies make 64 MiB
    assert gemm_pick.stream_copies(mid) * mid.numel() * 4 >= gemm_pick.STREAM_BYTES
    for form in FORMS:
        assert 0 < gemm_pick.time_form(form, torch.randn(16, 8), 4, budget_s=0.001, copies=3) < 1


def test_packed_rows_run_at_few_distinct_bucketed_counts():
    # each new row count makes oneDNN build a kernel (1-1.5 ms): varying counts share buckets
    buckets = [gemm_pick.row_bucket(m) for m in range(1, 4097)]
    assert buckets[:gemm_pick.EXACT_ROWS] == list(range(1, gemm_pick.EXACT_ROWS + 1))
    assert all(b >= m and b <= max(m, 1.125 * m + 1) for m, b in zip(range(1, 4097), buckets))
    assert all(a <= b for a, b in zip(buckets, buckets[1:]))
    assert len(set(buckets)) <= gemm_pick.EXACT_ROWS + 8 * 9


def test_a_first_start_shows_a_bar_while_it_times_and_a_cached_one_does_not(monkeypatch, tmp_path, capsys):
    """Timing every shape takes a minute or more on a first start: a progress bar says so; a start
    that finds every shape in the cache, or runs pinned forms, shows none."""
    monkeypatch.delenv("OURO_GEMM_PICK", raising=False)
    monkeypatch.setenv("OURO_CACHE", str(tmp_path))
    monkeypatch.setenv("OURO_BUSY_LIMIT", "1")
    monkeypatch.setattr(gemm_pick, "time_form", lambda form, weight, rows, budget_s=0.03: {"linear": 1.0}.get(form, 2.0))
    from ouro.models.loader import load_model
    from ouro.models.resolve import resolve_model
    model = load_model(resolve_model("tiny"))
    model_forms.apply_to(model)
    assert "timing each product's forms on this machine" in capsys.readouterr().err
    model_forms.apply_to(model)                                  # every shape cached now
    assert "timing each product" not in capsys.readouterr().err
    monkeypatch.setenv("OURO_GEMM_PICK", "linear")
    model_forms.apply_to(model)
    assert "timing each product" not in capsys.readouterr().err
