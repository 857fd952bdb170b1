"""W8A8: per-token activation and per-channel weight quantisation, every int8 product form against
the exact reference, the quantised modules against theirs, and batch invariance (a row's result
never depends on the other rows). Float32 throughout; NaN-poisoned outputs show unwritten rows."""

from __future__ import annotations

import pytest
import torch

from ouro.layers.linear import Linear
from ouro.layers.moe import Experts
from ouro.ops.quant import (
    QMAX,
    int8_mm_chunked,
    int8_mm_naive,
    quantize_rows,
    w8a8_experts_naive,
    w8a8_linear_naive,
)
from ouro.quant import int8_forms
from ouro.quant.int8_native import native
from ouro.quant.w8a8 import UNQUANTISED, W8A8Experts, W8A8Linear, quantize_model


def rel_rms(a, b):
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def int8(shape, gen, low=-QMAX, high=QMAX):
    return torch.randint(low, high + 1, shape, generator=gen, dtype=torch.int8)


# ---- quantisation ----

def test_rows_quantise_on_their_own_scale():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 50, generator=g)
    x[1] = 0                                    # an all-zero row
    x[2] *= 1e4                                 # an outlier row
    x[3, 7] = 300.0                             # an outlier value
    q, s = quantize_rows(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and q.shape == x.shape and s.shape == (6,)
    assert int(q.abs().max()) == QMAX and int(q.min()) >= -QMAX
    assert s[1] == 0 and (q[1] == 0).all()
    for r in range(6):                          # each row: max |q| is 127 (unless zero), the error within half a step
        if r != 1:
            assert int(q[r].abs().max()) == QMAX
        assert (q[r].float() * s[r] - x[r]).abs().max() <= s[r] / 2 + 1e-6 * x[r].abs().max()
    alone = quantize_rows(x[4:5])
    assert torch.equal(alone[0][0], q[4]) and torch.equal(alone[1][0], s[4])


@pytest.mark.parametrize("m, k", [(1, 7), (6, 50), (33, 512), (300, 77), (2048, 96)])
def test_the_native_row_quantisation_equals_torchs(m, k):
    """`quantize_for_int8` (ouro's one-pass op where it is built) gives `quantize_rows`' values: odd
    widths (the vector loop's tail), zero rows, outliers; a NaN row's scale is NaN either way."""
    from ouro.native.kernels import eager_only
    from ouro.quant.int8_native import native, why_not
    from ouro.quant.w8a8 import quantize_for_int8
    if native() is None:
        pytest.skip(f"ouro's int8 kernel is not built here: {why_not()}")
    g = torch.Generator().manual_seed(m * k)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 10
    x[0, k // 2] = 1e4
    if m > 2:
        x[1] = 0
        x[2, 0] = float("nan")
    q, s = quantize_for_int8(x)
    ref_q, ref_s = quantize_rows(x)
    finite = ~torch.isnan(ref_s)
    assert q.dtype == torch.int8 and q.shape == x.shape and s.shape == (m,)
    assert torch.equal(q[finite], ref_q[finite]) and torch.equal(s[finite], ref_s[finite])
    assert torch.equal(torch.isnan(s), ~finite)
    with eager_only():                               # the reference path is torch's own ops
        q2, s2 = quantize_for_int8(x)
    assert torch.equal(q2, ref_q) and torch.equal(s2[finite], ref_s[finite])


def test_a_nan_row_shows_in_its_output_only():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 40, generator=g)
    x[1, 5] = float("nan")
    w, ws = quantize_rows(torch.randn(8, 40, generator=g))
    y = w8a8_linear_naive(x, w, ws)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2]]).all()


# ---- the int8 product: every form that runs here, exact ----

SHAPES = [(1, 32, 8), (1, 33, 7), (3, 77, 24), (4, 2048, 16), (5, 100, 1), (16, 64, 96), (64, 31, 40),
          (65, 130, 33), (600, 96, 20)]


@pytest.mark.parametrize("form", int8_forms.FORMS)
@pytest.mark.parametrize("m, k, n", SHAPES)
def test_every_int8_form_equals_the_exact_reference(form, m, k, n):
    if int8_forms.form_runs(form) is not None:
        pytest.skip(f"{form} does not run here: {int8_forms.form_runs(form)}")
    g = torch.Generator().manual_seed(m * 1000 + k)
    x, w = int8((m, k), g), int8((n, k), g)
    x[0] = QMAX                                 # the largest sums: every product +127*127
    w[0] = QMAX
    if m > 1:
        x[1] = 0                                # an all-zero row
        x[-1] = -QMAX
    out = int8_forms.int8_mm(x, w, form)
    assert out.dtype == torch.int32 and out.shape == (m, n)
    assert torch.equal(out, int8_mm_naive(x, w))
    assert int(out[0, 0]) == k * QMAX * QMAX


def test_the_chunked_form_is_exact_past_float32s_integers():
    """K chunks keep every float32 partial sum below 2^24; one K=4096 chunk would not."""
    x = torch.full((2, 4096), QMAX, dtype=torch.int8)
    w = torch.full((3, 4096), QMAX, dtype=torch.int8)
    w[1, ::2] = -QMAX
    w[1, 1] = 1
    assert torch.equal(int8_mm_chunked(x, w), int8_mm_naive(x, w))


def test_a_miscomputing_or_raising_form_is_not_offered(monkeypatch):
    real = int8_forms.int8_mm

    def broken(x, w, form):
        if form == "chunked":
            return real(x, w, form) + 1
        if form == "int_mm":
            raise RuntimeError("no kernel here")
        return real(x, w, form)
    monkeypatch.setattr(int8_forms, "int8_mm", broken)
    monkeypatch.setattr(int8_forms, "_RUNS", {})
    assert "wrong result" in int8_forms.form_runs("chunked")
    assert "no kernel here" in int8_forms.form_runs("int_mm")
    assert "chunked" not in int8_forms.available_forms() and "int_mm" not in int8_forms.available_forms()
    monkeypatch.setenv("OURO_INT8_FORM", "chunked")
    with pytest.raises(ValueError, match="does not run on this machine"):
        int8_forms.pick_forms()


def test_the_native_kernel_is_built_here_or_says_why():
    from ouro.quant.int8_native import native, why_not
    assert (native() is None) == (why_not() is not None)
    if native() is not None:
        assert native().features() in ("avx2", "avx2+vnni", "avx512+vnni", "scalar")
        assert int8_forms.form_runs("native") is None


# ---- the quantised modules ----

@pytest.fixture(params=[f for f in int8_forms.FORMS if int8_forms.form_runs(f) is None])
def forms(request):
    return [request.param] * len(int8_forms.ROWS)


@pytest.mark.parametrize("rows", [1, 2, 7, 64, 600])
def test_w8a8_linear_equals_its_reference_and_is_batch_invariant(forms, rows):
    g = torch.Generator().manual_seed(rows)
    lin = Linear(96, 40, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(40, 96, generator=g))
        lin.weight[3] *= 50                     # an outlier channel keeps its own scale
    q = W8A8Linear.from_linear(lin, forms)
    x = torch.randn(rows, 96, generator=g)
    x[0] *= 1e3                                 # an outlier token
    with torch.no_grad():
        y = q(x)
    assert torch.equal(y, w8a8_linear_naive(x, q.qweight, q.weight_scale))
    # each term's rounding is at most half a step of each factor: the error is bounded by |x| @ |w|.T / 127
    exact = (x.double() @ lin.weight.detach().double().T)
    bound = (x.double().abs() @ lin.weight.detach().double().abs().T) / QMAX
    assert ((y.double() - exact).abs() <= bound).all()
    for r in {0, rows // 2, rows - 1}:          # each row alone gives the same bits
        assert torch.equal(q(x[r:r + 1])[0], y[r])


def test_per_channel_weight_scales_matter():
    """Mutation: one scale for the whole weight (per tensor) loses the small channels."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 64, generator=g)
    w[0] *= 100
    q, s = quantize_rows(w)
    x = torch.randn(5, 64, generator=g)
    per_channel = w8a8_linear_naive(x, q, s)
    t_scale = w.abs().max() / QMAX
    per_tensor = w8a8_linear_naive(x, torch.round(w / t_scale).clamp(-QMAX, QMAX).to(torch.int8),
                                   t_scale.expand(16))
    exact = x @ w.T
    assert rel_rms(per_channel[:, 1:], exact[:, 1:]) < 2e-2 < rel_rms(per_tensor[:, 1:], exact[:, 1:])


def _experts(config, g):
    ex = Experts(config)
    with torch.no_grad():
        ex.gate_up_proj.copy_(torch.randn(ex.gate_up_proj.shape, generator=g) * 0.3)
        ex.down_proj.copy_(torch.randn(ex.down_proj.shape, generator=g) * 0.3)
    return ex


@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_w8a8_experts_equal_their_reference(forms, tokens):
    from ouro.models.presets import PRESETS
    c = PRESETS["tiny"]
    g = torch.Generator().manual_seed(tokens)
    ex = _experts(c, g)
    q = W8A8Experts(ex, forms)
    E, k = c.n_routed_experts, c.num_experts_per_tok
    x = torch.randn(tokens, c.hidden_size, generator=g)
    experts = torch.rand(tokens, E, generator=g).argsort(-1)[:, :k]
    weights = torch.rand(tokens, k, generator=g)
    with torch.no_grad():
        y = q(x, weights, experts)
        ref = w8a8_experts_naive(x, weights, experts, q.gate_up_proj_q, q.gate_up_proj_scale, q.down_proj_q,
                                 q.down_proj_scale, c.swiglu_limit)
        full = ex(x, weights, experts)
    assert rel_rms(y, ref) < 1e-6
    assert rel_rms(y, full) < 5e-2
    assert torch.equal(q(x[-1:], weights[-1:], experts[-1:])[0], y[-1])   # batch invariant


# ---- the model ----

def _model(preset="tiny", seed=0):
    from ouro.models.glm5_next import Glm5NextModel
    from ouro.models.presets import PRESETS
    torch.manual_seed(seed)
    m = Glm5NextModel(PRESETS[preset])
    with torch.no_grad():
        for p in m.parameters():                # every weight random (no constant init left unchecked)
            p.copy_(torch.randn_like(p) * 0.05)
    return m.eval()


def test_quantize_model_replaces_projections_and_keeps_the_listed_ones():
    m = _model()
    report = quantize_model(m)
    names = dict(m.named_modules())
    assert isinstance(names["lm_head"], Linear) and "lm_head" in report["kept"]
    for name, mod in names.items():
        if name.endswith(("indexer.weights_proj", "kv_b_proj")):
            assert isinstance(mod, Linear) and name in report["kept"]
        elif isinstance(mod, Linear) and name != "lm_head":
            raise AssertionError(f"{name} was left unquantised")
    assert any(isinstance(mod, W8A8Experts) for mod in names.values())
    assert any(n.endswith("self_attn.q_proj") and isinstance(mod, W8A8Linear) for n, mod in names.items())
    assert all(isinstance(names[n], (W8A8Linear, W8A8Experts)) for n in report["quantized"])
    assert set(UNQUANTISED) == {"lm_head", "*.indexer.weights_proj", "*.kv_b_proj"}


def test_ignore_is_configurable():
    m = _model()
    report = quantize_model(m, ignore=("*.mlp.experts", "*.o_proj"))
    assert any(n.endswith("mlp.experts") for n in report["kept"]) and any(n.endswith("o_proj") for n in report["kept"])
    assert "lm_head" in report["quantized"]
    with pytest.raises(ValueError, match="quantization must be one of"):
        quantize_model(_model(), "w4a16")


def test_quantised_model_stays_close_to_float32_and_hooks_still_fire():
    from ouro.engine.simple_runner import SimpleRunner
    ref_model, q_model = _model(seed=1), _model(seed=1)
    quantize_model(q_model)
    seen = []
    q_model.layers[0].self_attn.q_proj.register_forward_hook(lambda mod, a, out: seen.append(out.shape))
    prompt = [list(range(5, 29))]
    ref = SimpleRunner(ref_model, 1, 64).step(prompt, logits="all")
    out = SimpleRunner(q_model, 1, 64).step(prompt, logits="all")
    err = rel_rms(out, ref)
    assert 0 < err < 0.1, err
    assert seen


@pytest.mark.parametrize("counts", [[0, 3, 0, 1], [5, 0, 0, 0], [0, 0, 0, 0], [1, 1, 64, 2]])
def test_grouped_products_equal_one_product_per_expert(forms, counts):
    from ouro.quant.w8a8 import w8a8_grouped
    g = torch.Generator().manual_seed(sum(counts))
    E, N, K = len(counts), 24, 70
    q, s = quantize_rows(torch.randn(E, N, K, generator=g))
    x = torch.randn(sum(counts), K, generator=g)
    out = w8a8_grouped(x, q, s, torch.tensor(counts), forms)
    start = 0
    for e, c in enumerate(counts):
        assert torch.equal(out[start:start + c], w8a8_linear_naive(x[start:start + c], q[e], s[e]))
        start += c
    assert out.shape == (sum(counts), N)


def test_the_native_kernel_refuses_bad_offsets_and_shapes():
    from ouro.quant.int8_native import native
    if native() is None:
        pytest.skip("ouro's kernel is not built here")
    p = native().pack_weight(torch.zeros(2, 4, 8, dtype=torch.int8))
    s = torch.ones(2, 4)
    with pytest.raises(RuntimeError, match="offsets"):
        native().w8a8_packed(torch.zeros(3, 8), p, s, torch.tensor([0, 2, 1]), 4)
    with pytest.raises(RuntimeError, match="offsets"):
        native().w8a8_packed(torch.zeros(3, 8), p, s, torch.tensor([0, 1, 5]), 4)
    with pytest.raises(RuntimeError, match="another shape"):
        native().w8a8_packed(torch.zeros(3, 12), p, s, torch.tensor([0, 1, 3]), 4)


def test_a_weight_changed_in_place_is_packed_again(forms):
    g = torch.Generator().manual_seed(9)
    lin = Linear(40, 16, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(16, 40, generator=g))
    q = W8A8Linear.from_linear(lin, forms)
    x = torch.randn(3, 40, generator=g)
    before = q(x)
    with torch.no_grad():
        q.qweight.neg_()
    assert torch.equal(q(x), -before)


@pytest.mark.skipif(native() is None, reason="ouro's int8 kernel is not built here")
def test_quantize_model_packs_every_native_weight_before_the_first_forward(monkeypatch):
    """quantize_model makes the kernel-layout copies up front (`prepack`): a forward then packs
    nothing, and its output equals a model packed lazily at its first forward."""
    import ouro.quant.w8a8 as w8a8
    from ouro.quant import packed
    from ouro.engine.simple_runner import SimpleRunner
    m, lazy = _model(), _model()
    quantize_model(m)
    with monkeypatch.context() as patch:
        patch.setattr(w8a8, "prepack", lambda model: None)
        quantize_model(lazy)
    natives = [mod for mod in m.modules() if isinstance(mod, (W8A8Linear, W8A8Experts)) and "native" in mod.int8_forms]
    assert natives and all(mod in packed._PACKED for mod in natives)
    assert not any(mod in packed._PACKED for mod in lazy.modules())
    packs = {mod: {k: v[1] for k, v in packed._PACKED[mod].items()} for mod in natives}
    prompt = [list(range(5, 29))]
    got = SimpleRunner(m, 1, 64).step(prompt, logits="all")
    assert all(packed._PACKED[mod][k][1] is v for mod, p in packs.items() for k, v in p.items()), "packed again"
    assert torch.equal(got, SimpleRunner(lazy, 1, 64).step(prompt, logits="all"))
    assert any(mod in packed._PACKED for mod in lazy.modules())      # the lazy model packed at its forward

