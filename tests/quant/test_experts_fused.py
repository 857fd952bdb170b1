"""W8A8 routed experts as one native call (`int8_mm.cpp`'s `w8a8_experts`, run by W8A8Experts.eager
on host float32 rows): the same result as the eager path (by_expert, two grouped int8 products, the
clamped SwiGLU, combine; its reference under `kernels.eager_only()`) and as the dequantised math in
float64, whatever the thread count and whatever tokens share the batch; and the same greedy tokens
through the engine."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.numerics import rel_rms
from ouro.layers.moe import Experts
from ouro.native.kernels import eager_only
from ouro.ops.quant import quantize_rows
from ouro.quant.int8_native import native, why_not
from ouro.quant.w8a8 import W8A8Experts
from tests.helpers.fused_run import run

pytestmark = pytest.mark.skipif(native() is None, reason=f"ouro's int8 kernel is not built here ({why_not()})")

SHAPES = [(3, 24, 8), (8, 72, 40), (32, 512, 256)]          # (experts, hidden, intermediate): odd tails
NO_LIMIT = float("inf")                                     # an unset clamp: clamp(-inf, inf) is the identity


def experts_module(E, D, I, k, limit, seed=0):
    g = torch.Generator().manual_seed(seed)
    c = SimpleNamespace(n_routed_experts=E, hidden_size=D, moe_intermediate_size=I, swiglu_limit=limit,
                        num_experts_per_tok=k)
    ex = Experts(c)
    with torch.no_grad():
        ex.gate_up_proj.copy_(torch.randn(ex.gate_up_proj.shape, generator=g) * 0.3)
        ex.down_proj.copy_(torch.randn(ex.down_proj.shape, generator=g) * 0.3)
        ex.gate_up_proj[:, 1] *= 20                          # an outlier channel keeps its own scale
    return W8A8Experts(ex, ["native"] * 3)


def routing(T, k, E, how, seed=0):
    """(weights [T, k], experts [T, k]): `random` choices, or `same` (every token picks the same experts)."""
    g = torch.Generator().manual_seed(seed + 1)
    if how == "same":
        experts = torch.arange(E - 1, E - 1 - k, -1).expand(T, k).clone()
    else:
        experts = torch.rand(T, E, generator=g).argsort(-1)[:, :k]
    return torch.rand(T, k, generator=g), experts


def inputs(T, D, seed=0):
    g = torch.Generator().manual_seed(seed + 2)
    x = torch.randn(T, D, generator=g) * 2
    x[0] *= 30                                              # an outlier token
    return x


def float64_reference(q, x, weights, experts):
    """The dequantised math in float64: rows quantised per row (the scheme's float32 scales), exact
    products, the clamped SwiGLU, h quantised per row, the weighted sum."""
    lim = float(q.limit)
    out = torch.zeros(x.shape, dtype=torch.float64)
    qx, sx = quantize_rows(x)
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            gu = (qx[t].double() @ q.gate_up_proj_q[e].double().T) * sx[t].double() * q.gate_up_proj_scale[e].double()
            gate, up = gu.chunk(2)
            h = F.silu(gate.clamp(max=lim)) * up.clamp(-lim, lim)
            qh, sh = quantize_rows(h.unsqueeze(0))
            y = (qh[0].double() @ q.down_proj_q[e].double().T) * sh[0].double() * q.down_proj_scale[e].double()
            out[t] += weights[t, j].double() * y
    return out


def both(q, x, weights, experts):
    with torch.no_grad():
        assert q.fused(x, experts)
        got = q(x, weights, experts)
        with eager_only():
            assert not q.fused(x, experts)
            ref = q(x, weights, experts)
    return got, ref


@pytest.mark.parametrize("limit", [0.5, NO_LIMIT], ids=["limit", "no_limit"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"E{e}_D{d}_I{i}" for e, d, i in SHAPES])
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("T", [1, 2, 5, 16, 64])
def test_fused_equals_the_eager_path_and_the_float64_math(T, k, shape, limit):
    E, D, I = shape
    if k > E:
        pytest.skip("a token picks an expert once")
    q = experts_module(E, D, I, k, limit, seed=T)
    x = inputs(T, D, seed=T * k)
    for how in ("random", "same"):          # most experts without rows (E=32, T=1); one expert for all
        weights, experts = routing(T, k, E, how, seed=T + E)
        got, ref = both(q, x, weights, experts)
        assert not got.isnan().any()
        assert rel_rms(got, ref) <= 1e-6, (how, rel_rms(got, ref))
        exact = float64_reference(q, x, weights, experts)
        assert rel_rms(got.double(), exact) <= 1e-6, (how, rel_rms(got.double(), exact))


def test_the_clamp_bites_and_the_halves_are_not_swapped():
    """The same weights with the limit unset give another result (the clamp matters at 0.5), and
    the float64 math with gate and up exchanged is far from the fused result."""
    T, k, (E, D, I) = 16, 4, SHAPES[1]
    x = inputs(T, D)
    weights, experts = routing(T, k, E, "random")
    clamped, _ = both(experts_module(E, D, I, k, 0.5), x, weights, experts)
    free, _ = both(experts_module(E, D, I, k, NO_LIMIT), x, weights, experts)
    assert rel_rms(clamped, free) > 1e-2
    q = experts_module(E, D, I, k, NO_LIMIT)
    swapped = experts_module(E, D, I, k, NO_LIMIT)
    with torch.no_grad():
        half = swapped.gate_up_proj_q.shape[1] // 2
        for name in ("gate_up_proj_q", "gate_up_proj_scale"):
            t = getattr(swapped, name)
            t.copy_(torch.cat([t[:, half:], t[:, :half]], 1))
    got, _ = both(q, x, weights, experts)
    assert rel_rms(got.double(), float64_reference(swapped, x, weights, experts)) > 1e-2


def test_a_nan_token_shows_in_its_own_output_only():
    T, k, (E, D, I) = 5, 2, SHAPES[1]
    q = experts_module(E, D, I, k, 1.0)
    x = inputs(T, D)
    x[2, 7] = float("nan")
    weights, experts = routing(T, k, E, "random")
    got, ref = both(q, x, weights, experts)
    assert got[2].isnan().all() and ref[2].isnan().all()
    rest = [0, 1, 3, 4]
    assert not got[rest].isnan().any()
    assert rel_rms(got[rest], ref[rest]) <= 1e-6


@pytest.mark.parametrize("shape", SHAPES[1:], ids=["E8", "E32"])
def test_the_thread_count_changes_no_bit(shape):
    E, D, I = shape
    T, k = 64, 4
    q = experts_module(E, D, I, k, 1.0)
    x = inputs(T, D)
    weights, experts = routing(T, k, E, "random")
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with torch.no_grad():
            one = q(x, weights, experts)
        torch.set_num_threads(2)
        with torch.no_grad():
            two = q(x, weights, experts)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(one, two)


@pytest.mark.parametrize("shape", SHAPES, ids=[f"E{e}" for e, _, _ in SHAPES])
def test_a_token_alone_equals_it_in_a_batch_of_16(shape):
    E, D, I = shape
    T, k = 16, min(4, E)
    q = experts_module(E, D, I, k, 1.0)
    x = inputs(T, D)
    weights, experts = routing(T, k, E, "random")
    with torch.no_grad():
        batch = q(x, weights, experts)
        for t in (0, 7, 15):
            assert torch.equal(q(x[t:t + 1], weights[t:t + 1], experts[t:t + 1])[0], batch[t])


def test_the_fused_call_is_for_host_float32_inference_only():
    q = experts_module(8, 72, 40, 2, 1.0)
    x = inputs(3, 72)
    _, experts = routing(3, 2, 8, "random")
    with torch.no_grad():
        assert q.fused(x, experts)
        assert not q.fused(x.bfloat16(), experts)
        with eager_only():
            assert not q.fused(x, experts)
    assert not q.fused(x, experts)                 # autograd on: the eager ops
    q.int8_forms = ["int_mm"] * 3
    with torch.no_grad():
        assert not q.fused(x, experts)             # another form measured faster: the grouped path


def test_the_engine_gives_the_same_greedy_tokens_fused_and_eager(tiny_checkpoint, monkeypatch):
    """`LLM("tiny", quantization="w8a8")`'s engine: the fused experts (counted) and the eager path give
    the same greedy tokens, and logits within float32 rounding."""
    calls = []
    fn = native().w8a8_experts
    monkeypatch.setattr(native(), "w8a8_experts", lambda *a: calls.append(a[0].shape[0]) or fn(*a))
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 200) for _ in range(n)] for n in (7, 30, 19, 44)]
    mode = {"quantization": "w8a8"}
    with eager_only():
        ref = run(tiny_checkpoint, prompts, mode)
    assert not calls
    got = run(tiny_checkpoint, prompts, mode)
    assert calls and max(calls) > 1                # prefill rows and decode rows through the fused call
    for (t_ref, l_ref), (t_got, l_got) in zip(ref, got):
        assert t_got == t_ref
        assert not l_got.isnan().any()
        assert rel_rms(l_got, l_ref) <= 1e-5
