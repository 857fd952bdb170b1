"""The router, the norms and the clamped SwiGLU as native ops (`ouro/native/router.cpp`,
`norms.cpp`) against the eager code they replace, on every path this machine runs. The router
picks exactly the eager code's experts, in its order, exact and near ties included (its scores are
torch's product and sigmoid, its selections torch.topk's own loop), with weights to float32
rounding; a whole tiny model gives the same greedy tokens fused and eager."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

from ouro.layers.norm import GatedRMSNorm, RMSNorm
from ouro.native import kernels, norms
from ouro.native import router as fr
from ouro.ops import batch_invariant
from ouro.ops.moe import clamped_swiglu, route


def rel_rms(a, b):
    return float((a.double() - b.double()).square().mean().sqrt() / b.double().square().mean().sqrt())


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        assert fr.can(torch.ones(1)) and norms.can(torch.ones(1)), (kernels.why_not("router"), kernels.why_not("norms"))
        yield


def path_of(family, path):
    return kernels.portable(family) if path == "portable" else contextlib.nullcontext()


def eager_route(x, w, bias, *args):
    return route(x.float() @ w.float().T, bias, *args)


def check_route(x, w, bias, args, path="native"):
    ref_w, ref_e = eager_route(x, w, bias, *args)
    with path_of("router", path):
        got_w, got_e = fr.route(x, w, bias, *args)
    assert torch.equal(got_e, ref_e), args
    assert rel_rms(got_w, ref_w) <= 1e-6
    return got_w, got_e


GROUPINGS = [(8, 1, 1, 2), (8, 4, 2, 3), (32, 1, 1, 4), (32, 4, 2, 4), (32, 8, 3, 6), (64, 8, 3, 6), (64, 4, 4, 8),
             (96, 8, 8, 8), (96, 4, 1, 5), (12, 3, 2, 3)]       # (E, n_group, topk_group, top_k)


@pytest.mark.parametrize("path", ["native", "portable"])
@pytest.mark.parametrize("T", [1, 5, 16, 64])
@pytest.mark.parametrize("E,n_group,topk_group,top_k", GROUPINGS)
@pytest.mark.parametrize("norm", [True, False])
def test_route_equals_eager_and_float64(path, T, E, n_group, topk_group, top_k, norm):
    g = torch.Generator().manual_seed(T * E + top_k)
    D = 40
    x, w, bias = torch.randn(T, D, generator=g), torch.randn(E, D, generator=g) / 6, torch.randn(E, generator=g) * 0.1
    args = (top_k, n_group, topk_group, norm, 2.5)
    got_w, got_e = check_route(x, w, bias, args, path)
    w64, e64 = eager_route(x.double(), w.double(), bias.double(), *args)
    assert torch.equal(got_e, e64)
    ref_w, _ = eager_route(x, w, bias, *args)
    assert rel_rms(got_w, w64) <= 2 * rel_rms(ref_w, w64) + 1e-7


def tied(E, D, distinct, g):
    """A router weight whose E rows take only `distinct` values: many experts score exactly alike."""
    return torch.randn(distinct, D, generator=g)[torch.randint(0, distinct, (E,), generator=g)]


@pytest.mark.parametrize("E,n_group,topk_group,top_k", GROUPINGS)
@pytest.mark.parametrize("distinct", [1, 2, 3, 5])
def test_route_exact_ties_pick_the_eager_experts(E, n_group, topk_group, top_k, distinct):
    """Equal scores (duplicate router rows, a zero bias) and hence equal group scores: torch.topk's
    order among equal values is no fixed rule (topk([1, 3, 3, 2, 3], 2) gives indices [2, 4]),
    and the fused router reproduces it."""
    g = torch.Generator().manual_seed(E * 7 + distinct)
    D = 16
    w = tied(E, D, distinct, g)
    x = torch.randn(33, D, generator=g)
    for bias in (torch.zeros(E), torch.randint(0, 2, (E,), generator=g).float() * 0.5):
        check_route(x, w, bias, (top_k, n_group, topk_group, True, 1.0))
        check_route(torch.zeros(3, D), w, bias, (top_k, n_group, topk_group, False, 1.0))   # every logit 0


def test_route_group_ties_and_near_ties():
    """Group 2 a copy of group 0 (equal group scores), and experts one float32 step apart."""
    D, E = 16, 32
    g = torch.Generator().manual_seed(1)
    w = torch.randn(E, D, generator=g)
    w[16:24] = w[0:8]
    w[5], w[9], w[20] = w[3], w[3], w[3]
    w[11] = w[10] * (1 + 2 ** -23)
    w[27] = w[26].nextafter(w[26] + 1)
    x = torch.randn(40, D, generator=g)
    for args in ((4, 4, 2, True, 1.0), (6, 1, 1, False, 1.0), (3, 4, 1, True, 1.0), (8, 8, 3, True, 2.5)):
        check_route(x, w, torch.zeros(E), args)


def test_route_nan_rows_match_eager():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(4, 16, generator=g), torch.randn(32, 16, generator=g)
    x[1, 3] = float("nan")
    w[7, 0] = float("nan")
    ref_w, ref_e = eager_route(x, w, torch.zeros(32), 4, 4, 2, True, 1.0)
    got_w, got_e = fr.route(x, w, torch.zeros(32), 4, 4, 2, True, 1.0)
    assert torch.equal(got_e, ref_e)
    assert torch.equal(got_w.isnan(), ref_w.isnan())


def test_route_deterministic_mode_equals_eager_and_is_batch_invariant():
    g = torch.Generator().manual_seed(3)
    x, w, bias = torch.randn(16, 64, generator=g), torch.randn(32, 64, generator=g) / 8, torch.randn(32, generator=g) / 10
    args = (4, 4, 2, True, 2.5)
    batch_invariant.enable()
    try:
        got_w, _ = check_route(x, w, bias, args)
        one_w, one_e = fr.route(x[5:6], w, bias, *args)
    finally:
        batch_invariant.disable()
    assert torch.equal(one_w, got_w[5:6])


def test_route_refuses_a_bad_grouping():
    with pytest.raises(RuntimeError, match="groups"):
        fr.route(torch.randn(2, 8), torch.randn(10, 8), torch.zeros(10), 2, 4, 2, True, 1.0)


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
    with path_of("norms", path):
        got = norm(*inputs)
    assert rel_rms(got, ref) <= 1e-6
    assert rel_rms(got, ref64) <= 2 * rel_rms(ref, ref64) + 2e-7
    with kernels.eager_only():
        assert rel_rms(norm(*inputs), ref) <= 1e-6
    with path_of("norms", path):     # a row's result does not depend on the rows beside it
        assert torch.equal(norm(*(t[1:2] for t in inputs)), got[1:2])


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
    with path_of("norms", path):
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
    with path_of("norms", path):
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
