"""The norms and the clamped SwiGLU as native ops (`ouro/native/norms.cpp`) against the eager code
they replace, on every path this machine runs; a whole tiny model gives the same greedy tokens with
every fused op (the router's own tests: `test_native_router.py`) as eager."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.numerics import rel_rms
from ouro.layers.norm import GatedRMSNorm, RMSNorm
from ouro.native import kernels, norms
from ouro.ops.moe import clamped_swiglu


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        assert norms.can(torch.ones(1)), kernels.why_not("norms")
        yield


def path_of(path):
    return kernels.portable("norms") if path == "portable" else contextlib.nullcontext()


def norm_refs(x, weight, eps, gate=None):
    """(float32 eager, float64) references of RMSNorm (times sigmoid(gate) when given)."""
    ref = weight * (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps))
    x64 = x.double()
    ref64 = weight.double() * x64 / (x64.square().mean(-1, keepdim=True) + eps).sqrt()
    if gate is not None:
        ref, ref64 = ref * torch.sigmoid(gate), ref64 * torch.sigmoid(gate.double())
    return ref, ref64


@pytest.mark.parametrize("path", ["native", "portable"])
@pytest.mark.parametrize("D", [1, 7, 64, 129])
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("gated", [False, True])
def test_norms_equal_eager_and_float64(path, D, rows, gated):
    g = torch.Generator().manual_seed(D + rows)
    norm = (GatedRMSNorm if gated else RMSNorm)(D, 1e-5)
    norm.weight.data = torch.randn(D, generator=g)
    x = torch.randn(rows, 3, D, generator=g) * 3
    gate = torch.randn(rows, 3, D, generator=g) * 4 if gated else None
    inputs = (x, gate) if gated else (x,)
    ref, ref64 = norm_refs(x, norm.weight, 1e-5, gate)
    with path_of(path):
        got = norm(*inputs)
    assert rel_rms(got, ref) <= 1e-6
    assert rel_rms(got, ref64) <= 2 * rel_rms(ref, ref64) + 2e-7
    with kernels.eager_only():
        assert rel_rms(norm(*inputs), ref) <= 1e-6
    with path_of(path):     # a row's result does not depend on the rows beside it
        assert torch.equal(norm(*(t[1:2] for t in inputs)), got[1:2])


@pytest.mark.parametrize("path", ["native", "portable"])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_rms_norm_reads_rows_of_a_wider_tensor_in_place(path, rows):
    """x a column slice of a merged product's output (MLA's kv_a half): the same bits as its contiguous
    copy, and no copy made (a clone under the profiler)."""
    g = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, 96, generator=g) * 3
    x, w = wide[:, 32:96], torch.randn(64, generator=g)
    assert x.stride() == (96, 1)
    with path_of(path):
        got = norms.rms_norm(x, w, 1e-6)
        assert torch.equal(got, norms.rms_norm(x.contiguous(), w, 1e-6))
        with torch.profiler.profile() as prof:
            norms.rms_norm(x, w, 1e-6)
    assert got.is_contiguous() and rel_rms(got, norm_refs(x, w, 1e-6)[0]) <= 1e-6
    assert not any(e.key in ("aten::clone", "aten::contiguous") and e.count for e in prof.key_averages())


def test_norms_keep_nan_to_its_row():
    x = torch.randn(3, 8)
    x[1, 2] = float("nan")
    for got in (norms.rms_norm(x, torch.ones(8), 1e-6), norms.gated_rms_norm(x, torch.randn(3, 8), torch.ones(8), 1e-6)):
        assert got[1].isnan().all() and not got[[0, 2]].isnan().any()


@pytest.mark.parametrize("path", ["native", "portable"])
@pytest.mark.parametrize("T,I", [(1, 1), (3, 7), (16, 256), (64, 33)])
def test_clamped_swiglu_equals_eager_on_the_merged_halves(path, T, I):
    g = torch.Generator().manual_seed(T * I)
    merged = torch.randn(T, 2 * I, generator=g) * 6           # values beyond the limit both ways
    merged.view(-1)[::5] = float("nan")
    gate, up = merged.split([I, I], dim=-1)                   # strided views, as MLP.forward gets them
    ref = clamped_swiglu(gate, up, 7.0)
    ref64 = clamped_swiglu(gate.double(), up.double(), 7.0)
    with path_of(path):
        got = norms.clamped_swiglu(gate, up, 7.0)
    assert torch.equal(got.isnan(), ref.isnan())
    ok = ~ref.isnan()
    if ok.any():
        assert rel_rms(got[ok], ref[ok]) <= 1e-6
        assert rel_rms(got[ok], ref64[ok]) <= 2 * rel_rms(ref[ok], ref64[ok]) + 2e-7


def test_clamped_swiglu_clamps_and_keeps_nan():
    gate = torch.tensor([[1.0, 20.0, float("nan"), -3.0, -200.0]])
    up = torch.tensor([[-20.0, 2.0, 1.0, float("nan"), 3.0]])
    got = norms.clamped_swiglu(gate, up, 7.0)
    ref = F.silu(gate.clamp(max=7.0)) * up.clamp(-7.0, 7.0)
    assert torch.equal(got.isnan(), ref.isnan())
    assert rel_rms(got[~got.isnan()], ref[~ref.isnan()]) <= 1e-6


@pytest.mark.parametrize("path", ["native", "portable"])
def test_sigmoid_at_the_extremes(path):
    """The vector exp's edges, through silu (no clamp) and the gated norm's gate, in vector lanes
    and the scalar tail: torch's values to float32 rounding (0 for torch's < 1e-33 below e^-87), NaN alike."""
    edges = [-float("inf"), -1e4, -100.0, -88.0, -87.31, -87.29, -20.0, -1e-30, -0.0, 0.0, 1e-30, 0.5, 20.0, 88.0,
             100.0, float("inf"), float("nan")]
    gate = torch.tensor(edges * 3 + edges[:5]).view(1, -1)
    with path_of(path):
        got = norms.clamped_swiglu(gate, torch.ones_like(gate), float("inf"))
        got_norm = norms.gated_rms_norm(torch.ones_like(gate), gate, torch.ones(gate.shape[1]), 0.0)
    for got, ref in ((got, F.silu(gate)), (got_norm, torch.sigmoid(gate))):
        assert torch.equal(got.isnan(), ref.isnan())
        ok = ~ref.isnan()
        torch.testing.assert_close(got[ok], ref[ok], rtol=1e-6, atol=1e-33)


def generate(model, prompts, steps):
    from ouro.engine.simple_runner import SimpleRunner
    runner = SimpleRunner(model, len(prompts), 64, poison=True)
    logits = [runner.step(prompts)]
    tokens = [logits[-1].argmax(-1)]
    for _ in range(steps):
        logits.append(runner.step([[int(t)] for t in tokens[-1]]))
        tokens.append(logits[-1].argmax(-1))
    return torch.stack(tokens), torch.stack(logits)


@pytest.mark.parametrize("preset", ["tiny", "tiny-py"])
def test_tiny_model_fused_equals_eager(tmp_path, preset):
    """Prefill and batched decode of a tiny model (random with a grouped router; trained): the
    same greedy tokens and logits to float32 rounding with every fused op as under eager_only()."""
    from ouro.models.loader import load_model
    from ouro.models.presets import TRAINED, make_model
    from ouro.models.resolve import resolve_model
    if preset in TRAINED:
        model = load_model(resolve_model(preset, progress=False))
    else:
        make_model(preset, tmp_path, progress=False)
        model = load_model(tmp_path)
    g = torch.Generator().manual_seed(5)
    V = model.config.vocab_size
    prompts = [torch.randint(1, V, (n,), generator=g).tolist() for n in (7, 3, 12, 5)]
    with kernels.eager_only():
        ref_t, ref_l = generate(model, prompts, 8)
    got_t, got_l = generate(model, prompts, 8)
    assert torch.equal(got_t, ref_t)
    assert not got_l.isnan().any()
    assert rel_rms(got_l, ref_l) <= 1e-6
