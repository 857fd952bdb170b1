"""FP8 W8A8 (`--quantization fp8`): e4m3 weights per channel and activations per token. Every fp8
form against the exact float64 reference, the modules and the model against their naive twins,
batch invariance, and the engine end to end."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.numerics import rel_rms
from ouro.ops.quant import E4M3, FP8_MAX, fp8_linear_naive, quantize_rows_fp8, w8a8_experts_naive
from ouro.quant import fp8_forms
from ouro.quant.w8a8 import W8A8Experts, W8A8Linear, quantize_model


def test_rows_are_quantised_each_on_its_own():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 50, generator=g)
    x[1] = 0
    x[2, 7] = 1e4                                     # an outlier row
    x[3, 3] = float("nan")
    q, s = quantize_rows_fp8(x)
    assert q.dtype == E4M3 and s.shape == (4,)
    assert s[1] == 0 and (q[1].float() == 0).all()
    assert torch.isnan(s[3])
    for r in (0, 2):
        assert s[r] == x[r].abs().max() / FP8_MAX
        assert q[r].float().abs().max() == FP8_MAX
        back = q[r].float() * s[r]
        assert rel_rms(back, x[r]) < 0.05                # 3 mantissa bits
    q2, s2 = quantize_rows_fp8(x[2:3])
    assert torch.equal(q2.view(torch.uint8), q[2:3].view(torch.uint8)) and torch.equal(s2, s[2:3])


def test_the_reference_is_exact():
    """Exact in float64 means independent of the order of the sum: reversed K gives the same bits."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(7, 300, generator=g) * 30, torch.randn(11, 300, generator=g) * 1e-3
    qw, sw = quantize_rows_fp8(w)
    assert torch.equal(fp8_linear_naive(x, qw, sw), fp8_linear_naive(x.flip(-1), qw.view(torch.uint8).flip(-1).view(E4M3), sw))


SHAPES = [(1, 32, 8), (1, 33, 7), (3, 77, 24), (4, 2048, 16), (16, 64, 96), (65, 130, 33), (600, 96, 20)]


@pytest.mark.parametrize("form", fp8_forms.FORMS)
@pytest.mark.parametrize("m, k, n", SHAPES)
def test_every_fp8_form_equals_the_exact_reference(form, m, k, n):
    if fp8_forms.form_runs(form) is not None:
        pytest.skip(f"{form} does not run here: {fp8_forms.form_runs(form)}")
    g = torch.Generator().manual_seed(m * 100 + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    x[0] *= 1e3
    if m > 1:
        x[1] = 0
    qw, sw = quantize_rows_fp8(w)
    qx, sx = quantize_rows_fp8(x)
    out = fp8_forms.fp8_mm(qx, sx, qw, sw, form)
    ref = fp8_linear_naive(x, qw, sw)
    assert out.dtype == torch.float32 and out.shape == (m, n) and not torch.isnan(out).any()
    assert rel_rms(out, ref) < 1e-6
    if m > 1:
        assert (out[1] == 0).all()


def test_a_wrong_form_is_not_offered(monkeypatch):
    real = fp8_forms.fp8_mm
    monkeypatch.setattr(fp8_forms, "fp8_mm", lambda qx, sx, qw, sw, form, padded=None: real(qx, sx, qw, sw, form) * 1.001)
    monkeypatch.setattr(fp8_forms, "_RUNS", {})
    assert "wrong result" in fp8_forms.form_runs("float")
    monkeypatch.setenv("OURO_FP8_FORM", "float")
    with pytest.raises(ValueError, match="does not run on cpu"):
        fp8_forms.pick_form()


@pytest.fixture(params=[f for f in fp8_forms.FORMS if fp8_forms.form_runs(f) is None])
def forms(request):
    return [request.param] * 3


@pytest.mark.parametrize("rows", [1, 2, 7, 64, 600])
def test_fp8_linear_equals_its_reference_and_is_batch_invariant(forms, rows):
    g = torch.Generator().manual_seed(rows)
    lin = torch.nn.Linear(96, 40, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(40, 96, generator=g))
        lin.bias.copy_(torch.randn(40, generator=g))
    q = W8A8Linear.from_linear(lin, forms, method="fp8")
    assert q.qweight.dtype == E4M3 and "fp8" in repr(q)
    x = torch.randn(rows, 96, generator=g)
    x[0, 5] = 500.0
    y = q(x)
    ref = fp8_linear_naive(x, q.qweight, q.weight_scale) + lin.bias
    assert rel_rms(y, ref) < 1e-6
    assert rel_rms(y, lin(x).detach()) < 0.1
    assert torch.equal(q(x[-1:])[0], y[-1])                       # a row alone: the same bits


def _experts_case(seed: int, tokens: int):
    """tiny's routed experts with random weights, and a random routing of `tokens` tokens."""
    from ouro.layers.moe import Experts
    from ouro.models.presets import PRESETS
    c = PRESETS["tiny"]
    g = torch.Generator().manual_seed(seed)
    ex = Experts(c)
    with torch.no_grad():
        ex.gate_up_proj.copy_(torch.randn(ex.gate_up_proj.shape, generator=g) * 0.3)
        ex.down_proj.copy_(torch.randn(ex.down_proj.shape, generator=g) * 0.3)
    E, k = c.n_routed_experts, c.num_experts_per_tok
    x = torch.randn(tokens, c.hidden_size, generator=g)
    experts = torch.rand(tokens, E, generator=g).argsort(-1)[:, :k]
    return ex, x, torch.rand(tokens, k, generator=g), experts, c


def test_fp8_experts_equal_their_reference(forms):
    ex, x, weights, experts, c = _experts_case(5, 9)
    q = W8A8Experts(ex, forms, method="fp8")
    with torch.no_grad():
        y = q(x, weights, experts)
        ref = w8a8_experts_naive(x, weights, experts, q.gate_up_proj_q, q.gate_up_proj_scale, q.down_proj_q,
                                 q.down_proj_scale, c.swiglu_limit, linear=fp8_linear_naive)
        full = ex(x, weights, experts)
    assert q.gate_up_proj_q.dtype == E4M3
    assert rel_rms(y, ref) < 1e-6
    assert rel_rms(y, full) < 0.1
    assert torch.equal(q(x[-1:], weights[-1:], experts[-1:])[0], y[-1])


def test_the_fp8_model_equals_its_naive_twin():
    from ouro.engine.simple_runner import SimpleRunner
    from ouro.models.glm5_next import Glm5NextModel
    from ouro.models.presets import PRESETS
    models = []
    for _ in range(3):
        torch.manual_seed(2)
        m = Glm5NextModel(PRESETS["tiny"])
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.randn_like(p) * 0.05)
        models.append(m.eval())
    fast, naive, full = models
    report = quantize_model(fast, "fp8")
    quantize_model(naive, "fp8", reference=True)
    assert report["quantized"] and "lm_head" in report["kept"]
    prompt = [list(range(5, 29))]
    out = SimpleRunner(fast, 1, 64, poison=True).step(prompt, logits="all")
    assert rel_rms(out, SimpleRunner(naive, 1, 64).step(prompt, logits="all")) < 1e-5
    assert 0 < rel_rms(out, SimpleRunner(full, 1, 64).step(prompt, logits="all")) < 0.1


@pytest.mark.parametrize("method", ["w8a8", "fp8"])
def test_the_capturable_expert_path_gives_the_host_paths_rows(method):
    """On an accelerator (or in a graph) the quantised experts cannot read their row counts: every
    expert runs all T rows zero-padded. Per-row quantisation keeps the padding inert: same rows."""
    from ouro.ops.capture import capture_path
    ex, x, weights, experts, _ = _experts_case(7, 6)
    q = W8A8Experts(ex, method=method)
    with torch.no_grad():
        host = q(x, weights, experts)
        with capture_path():
            captured = q(x, weights, experts)
    assert not torch.isnan(captured).any()
    assert rel_rms(captured, host) < 1e-6


def test_the_engine_serves_fp8(tmp_path):
    """`LLM(..., quantization="fp8")`: the e4m3 modules are in and greedy outputs are
    batch-invariant (per-row scales: a request's tokens never depend on its batch)."""
    from ouro.lab.reference.checkpoint import make_hf_checkpoint
    from ouro.engine.llm import LLM
    from ouro.engine.sampling import SamplingParams
    make_hf_checkpoint("tiny", tmp_path)
    llm = LLM(str(tmp_path), max_memory=64 << 20, page_size=16, quantization="fp8", max_num_seqs=8)
    model = llm.engine.runner.model
    assert any(isinstance(m, W8A8Linear) and m.qweight.dtype == E4M3 for m in model.modules())
    prompts = [[5 + i, 9, 11 + 2 * i, 40, 3] for i in range(6)]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    together = [o.token_ids for o in llm.generate(prompts, sp)]
    alone = [llm.generate([p], sp)[0].token_ids for p in prompts]
    assert together == alone
