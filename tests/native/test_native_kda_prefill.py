"""A prefill chunk of KDA as one native op (`kda_prefill`, `ouro/native/kda.cpp`): each sequence's
tokens in order through the decode step's arithmetic. Against the decode op token by token (the
same sums: bit for bit), a float64 recurrence, and the layer's eager chunked path; unused slots
NaN-poisoned and never touched; a context that exchanges the recurrence with other ranks (CP)
keeps the eager path."""

import pytest
import torch

from ouro.layers.context import ForwardContext, ModelCache
from ouro.native import kda as fk
from ouro.native import kernels

from tests.helpers.kda_cases import case, count_calls, float64_reference, kda_layer, rel_rms, run_layer

ARGS = ("mixed", "f", "b", "gate")


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        assert fk.can(torch.ones(1)), kernels.why_not("kda")
        yield


def sequences(lens, H, dk, K, seed):
    """Inputs for sequences of `lens` tokens, one slot each (scattered, some fresh), a cache with
    three spare slots poisoned with NaN."""
    T, N = sum(lens), len(lens)
    i, conv, rec, _, _ = case(T, H, dk, K, N + 3, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    slots = torch.randperm(N + 3, generator=g)[:N]
    fresh = torch.tensor([n % 3 == 0 for n in range(N)])
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    spare = torch.ones(N + 3, dtype=torch.bool)
    spare[slots] = False
    conv[spare], rec[spare] = float("nan"), float("nan")
    conv[slots[fresh]], rec[slots[fresh]] = float("nan"), float("nan")     # a fresh slot's leftovers
    return i, conv, rec, slots, fresh, starts, spare


def token_by_token(i, conv, rec, slots, fresh, starts, lb, eps, op):
    """Each sequence's tokens one decode step at a time (position j of every sequence together)."""
    outs = torch.full((starts[-1], *i["f"].shape[1:]), float("nan"))
    lens = (starts[1:] - starts[:-1]).tolist()
    for j in range(max(lens)):
        live = [n for n, L in enumerate(lens) if j < L]
        rows = torch.tensor([int(starts[n]) + j for n in live])
        first = torch.tensor([bool(fresh[n]) and j == 0 for n in live])
        o = op(*(i[a][rows] for a in ARGS), i["conv_w"], i["dt_bias"], i["A_log"], lb, i["norm_w"], eps, conv, rec,
               slots[live], first)
        outs[rows] = o.reshape(len(live), -1)
    return outs


def float64_sequences(i, conv, rec, slots, fresh, starts, lb, eps, H, dk):
    conv, rec = conv.double().clone(), rec.double().clone()
    step = lambda *a: float64_reference(dict(zip(ARGS + ("conv_w", "dt_bias", "A_log", "norm_w"), a[:8])),  # noqa: E731
                                        *a[8:], H, dk)
    outs = torch.full((int(starts[-1]), i["f"].shape[1]), float("nan"), dtype=torch.float64)
    for n in range(len(slots)):
        s = int(slots[n])
        for t in range(int(starts[n]), int(starts[n + 1])):
            y, c, r = step(*(i[a][t:t + 1] for a in ARGS), i["conv_w"], i["dt_bias"], i["A_log"], i["norm_w"],
                           conv, rec, torch.tensor([s]), torch.tensor([bool(fresh[n]) and t == starts[n]]), lb, eps)
            outs[t], conv[s], rec[s] = y[0], c[0], r[0]
    return outs, conv, rec


@pytest.mark.parametrize("path", ["native", "portable"])
@pytest.mark.parametrize("lens", [[1], [5, 1, 16], [37, 2], [64, 17, 9, 3], [3, 1, 2, 5] * 16])
@pytest.mark.parametrize("H,dk,K", [(1, 8, 4), (3, 24, 4), (2, 13, 3), (8, 64, 4)])
@pytest.mark.parametrize("lb", [-5.0, None])
def test_prefill_op_equals_decode_steps_bit_for_bit_and_float64(path, lens, H, dk, K, lb):
    i, conv, rec, slots, fresh, starts, spare = sequences(lens, H, dk, K, seed=sum(lens) + H)
    eps = 1e-5
    conv2, rec2 = conv.clone(), rec.clone()
    with kernels.portable("kda") if path == "portable" else torch.no_grad():
        out = fk.kda_prefill(*(i[a] for a in ARGS), i["conv_w"], i["dt_bias"], i["A_log"], lb, i["norm_w"], eps,
                             conv, rec, slots, fresh, starts)
        steps = token_by_token(i, conv2, rec2, slots, fresh, starts, lb, eps, fk.kda_decode)
    assert out.shape == (sum(lens), H, dk) and not out.isnan().any()
    out = out.reshape(sum(lens), -1)
    assert torch.equal(out, steps) and torch.equal(rec[slots], rec2[slots]) and torch.equal(conv[slots], conv2[slots])
    assert conv[spare].isnan().all() and rec[spare].isnan().all()             # never read, never written
    assert not conv[slots].isnan().any() and not rec[slots].isnan().any()     # fresh slots read as zero
    y64, c64, r64 = float64_sequences(i, *sequences(lens, H, dk, K, seed=sum(lens) + H)[1:6], lb, eps, H, dk)
    assert rel_rms(out, y64) <= 2e-6
    assert rel_rms(rec[slots], r64[slots]) <= 2e-6 and rel_rms(conv[slots], c64[slots]) <= 1e-7


def test_bad_starts_are_refused():
    i, conv, rec, slots, fresh, starts, _ = sequences([3, 2], 2, 8, 4, seed=0)
    slots, fresh = torch.cat([slots, slots[:1] * 0 + 4]), torch.cat([fresh, fresh[:1]])   # three sequences
    run = lambda s: fk.kda_prefill(*(i[a] for a in ARGS), i["conv_w"], i["dt_bias"], i["A_log"], -5.0,  # noqa: E731
                                   i["norm_w"], 1e-5, conv, rec, slots, fresh, s)
    with pytest.raises(RuntimeError, match="shape"):
        run(torch.tensor([0, 3, 4]))            # does not end at T
    with pytest.raises(RuntimeError, match="decrease"):
        run(torch.tensor([0, 4, 3, 5]))


# ---- the layer: a prefill batch through KDAttention, fused against its eager chunked path ----

def prefill_batch(config, lens, start, seed=0):
    g = torch.Generator().manual_seed(seed)
    N = len(lens)
    cache = ModelCache(config, N + 4, 64, 16)
    cache.conv.fill_(float("nan"))
    cache.recurrent.fill_(float("nan"))
    slots = torch.randperm(N + 4, generator=g)[:N]
    reused = slots[torch.tensor(start) > 0]
    cache.conv[:, reused] = torch.randn(cache.conv[:, reused].shape, generator=g)
    cache.recurrent[:, reused] = 0.3 * torch.randn(cache.recurrent[:, reused].shape, generator=g)
    pages = [[p * 4 + j for j in range(4)] for p in range(N)]
    ctx = ForwardContext.build(cache, lens, start, slots.tolist(), pages)
    return cache, ctx, torch.randn(sum(lens), config.hidden_size, generator=g), slots


@pytest.fixture
def prefill_calls(monkeypatch):
    return count_calls(monkeypatch, "kda_prefill")


@pytest.mark.parametrize("lens,start", [([40], [0]), ([7, 33, 2], [0, 12, 0]), ([17, 17], [5, 0])])
@pytest.mark.parametrize("H,dk,lb", [(3, 24, -5.0), (2, 16, None)])
def test_layer_prefill_fused_equals_its_eager_chunked_path(prefill_calls, lens, start, H, dk, lb):
    config, layer = kda_layer(H, dk, lb, seed=H + len(lens))
    cache, ctx, x, slots = prefill_batch(config, lens, start, seed=sum(lens))
    ref, ref_conv, ref_rec = run_layer(layer, cache, ctx, x, fused=False)
    assert not prefill_calls
    got, conv, rec = run_layer(layer, cache, ctx, x)
    assert len(prefill_calls) == 1 and not got.isnan().any()
    si = layer.state_index
    unused = torch.ones(cache.conv.shape[1], dtype=torch.bool)
    unused[slots] = False
    assert conv[si, unused].isnan().all() and rec[si, unused].isnan().all()
    # the chunked form and the recurrence round differently: float32 rounding over a sequence
    assert rel_rms(got, ref) <= 1e-5 and rel_rms(rec[si, slots], ref_rec[si, slots]) <= 1e-5
    assert torch.equal(conv[si, slots], ref_conv[si, slots])


def test_a_context_exchanging_the_recurrence_keeps_the_eager_path(prefill_calls):
    """A context-parallel context overrides `delta_rule` (KCP over ranks): no fused prefill there."""
    class Exchanging(ForwardContext):
        def delta_rule(self, *args, **kwargs):
            return super().delta_rule(*args, **kwargs)
    config, layer = kda_layer(2, 16, -5.0)
    cache, ctx, x, _ = prefill_batch(config, [9, 4], [0, 0])
    assert ctx.recurrence_is_local
    other = Exchanging(**{f: getattr(ctx, f) for f in ctx.__dataclass_fields__})
    assert not other.recurrence_is_local
    ref = run_layer(layer, cache, ctx, x, fused=False)[0]
    assert rel_rms(run_layer(layer, cache, other, x)[0], ref) <= 1e-6 and not prefill_calls
    run_layer(layer, cache, ctx, x)
    assert len(prefill_calls) == 1
