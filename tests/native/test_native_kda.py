"""The KDA decode step as one native op (`ouro/native/kda.cpp`) against the eager pieces it
replaces (conv step, L2 norms, forget gate, recurrent step, gated RMSNorm) and a float64 reference
written out here, on every path this machine runs: states updated in place in their slots only.
Then the layer (KDAttention's decode step, fused against its own eager path and float64, the eager
path kept where the output norm is watched or rows replay) and greedy decoding on the tiny model."""

import random

import pytest
import torch
import torch.nn.functional as F

from ouro.engine.speculative import KDARecord
from ouro.layers.context import ForwardContext, ModelCache
from ouro.layers.kda import l2_normalize
from ouro.layers.norm import GatedRMSNorm
from ouro.models.presets import PRESETS
from ouro.native import kda as fk
from ouro.native import kernels
from ouro.ops.conv1d import causal_conv1d
from ouro.ops.kda import kda_recurrent_step

from tests.helpers.fused_run import run as run_engine
from tests.helpers.kda_cases import case, count_calls, float64_reference, gate_of, kda_layer, rel_rms, run_layer


def eager(i, conv, rec, slots, fresh, lb, eps, H, dk):
    """The layer's eager decode pieces, float32."""
    T = i["mixed"].shape[0]
    cs, rs = conv[slots].clone(), rec[slots].clone()
    cs[fresh], rs[fresh] = 0.0, 0.0
    out, new_conv = causal_conv1d(i["mixed"][:, :, None], i["conv_w"], cs, torch.ones(T, dtype=torch.long))
    q, k, v = (t.reshape(T, H, dk) for t in F.silu(out[..., 0]).chunk(3, dim=-1))
    q, k = l2_normalize(q) * dk ** -0.5, l2_normalize(k)
    o = kda_recurrent_step(q, k, v, gate_of(i["f"], i["dt_bias"], i["A_log"], lb, H, dk), torch.sigmoid(i["b"]), rs)
    norm = GatedRMSNorm(dk, eps)
    norm.weight.data = i["norm_w"]
    return norm(o, i["gate"].view(T, H, dk)).reshape(T, -1), new_conv, rs


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        assert fk.can(torch.ones(1)), kernels.why_not("kda")
        yield


@pytest.mark.parametrize("path", ["native", "portable"])
@pytest.mark.parametrize("T", [1, 3, 16, 64])
@pytest.mark.parametrize("H,dk,K", [(1, 8, 4), (3, 24, 4), (2, 13, 3), (8, 64, 4)])
@pytest.mark.parametrize("lb", [-5.0, None])
def test_op_equals_the_eager_step_and_float64(path, T, H, dk, K, lb):
    S = T + 5
    i, conv, rec, slots, fresh = case(T, H, dk, K, S, seed=T * 7 + H)
    eps = 1e-5
    ref_o, ref_conv, ref_rec = eager(i, conv, rec, slots, fresh, lb, eps, H, dk)
    r64_o, r64_conv, r64_rec = float64_reference(i, conv, rec, slots, fresh, lb, eps, H, dk)
    untouched = torch.ones(S, dtype=torch.bool)
    untouched[slots] = False
    conv[untouched], rec[untouched] = float("nan"), float("nan")    # other slots: never read, never written
    with kernels.portable("kda") if path == "portable" else torch.no_grad():
        out = fk.kda_decode(i["mixed"], i["f"], i["b"], i["gate"], i["conv_w"], i["dt_bias"], i["A_log"], lb,
                            i["norm_w"], eps, conv, rec, slots, fresh)
    assert out.shape == (T, H, dk) and not out.isnan().any()
    out = out.reshape(T, -1)
    assert conv[untouched].isnan().all() and rec[untouched].isnan().all()
    assert rel_rms(out, ref_o) <= 1e-6
    assert rel_rms(rec[slots], ref_rec) <= 1e-6 and torch.equal(conv[slots], ref_conv)
    assert rel_rms(out, r64_o) <= 2 * rel_rms(ref_o, r64_o) + 3e-7
    assert rel_rms(rec[slots], r64_rec) <= 2 * rel_rms(ref_rec, r64_rec) + 3e-7


def test_a_token_alone_equals_it_in_a_batch_bit_for_bit():
    H, dk, K, T = 3, 16, 4, 16
    i, conv, rec, slots, fresh = case(T, H, dk, K, T)
    conv2, rec2 = conv.clone(), rec.clone()
    full = fk.kda_decode(i["mixed"], i["f"], i["b"], i["gate"], i["conv_w"], i["dt_bias"], i["A_log"], -5.0,
                         i["norm_w"], 1e-5, conv, rec, slots, fresh)
    t = 5
    alone = fk.kda_decode(*(i[n][t:t + 1] for n in ("mixed", "f", "b", "gate")), i["conv_w"], i["dt_bias"],
                          i["A_log"], -5.0, i["norm_w"], 1e-5, conv2, rec2, slots[t:t + 1], fresh[t:t + 1])
    assert torch.equal(alone[0], full[t]) and torch.equal(rec2[slots[t]], rec[slots[t]])


@pytest.mark.parametrize("T", [1, 2])
def test_a_step_split_over_threads_equals_one_thread_bit_for_bit(T):
    """A decode step's (sequence, head) tasks split over the threads from ~64 KB of states (4 heads
    of 64 x 64): the outputs and states are bit-identical to one thread's."""
    H, dk, K = 8, 64, 4
    i, conv, rec, slots, fresh = case(T, H, dk, K, T + 2, seed=11)
    runs = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            c, r = conv.clone(), rec.clone()
            out = fk.kda_decode(i["mixed"], i["f"], i["b"], i["gate"], i["conv_w"], i["dt_bias"], i["A_log"], -5.0,
                                i["norm_w"], 1e-5, c, r, slots, fresh)
            runs.append((out, c, r))
    finally:
        torch.set_num_threads(threads)
    assert not runs[0][0].isnan().any()
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_bad_slots_and_shapes_are_refused():
    i, conv, rec, slots, fresh = case(2, 2, 8, 4, 4)
    args = lambda s: (i["mixed"], i["f"], i["b"], i["gate"], i["conv_w"], i["dt_bias"], i["A_log"], -5.0,  # noqa: E731
                      i["norm_w"], 1e-5, conv, rec, s, fresh)
    with pytest.raises(RuntimeError, match="outside"):
        fk.kda_decode(*args(torch.tensor([0, 4])))
    with pytest.raises(RuntimeError, match="shape"):
        fk.kda_decode(i["mixed"], i["f"][:, :-1], *list(args(slots))[2:])


# ---- the layer: KDAttention's decode step, fused against its own eager path ----


def decode_batch(config, B, order, seed=0):
    """A decode batch of B sequences over a cache of B + 5 slots: slots scattered or consecutive, about a
    third of them fresh (their slot holds NaN, a finished sequence's leftovers read as zero), every slot
    no sequence of the batch owns poisoned with NaN."""
    g = torch.Generator().manual_seed(seed)
    S = B + 5
    cache = ModelCache(config, S, 4, 16)
    cache.conv.fill_(float("nan"))
    cache.recurrent.fill_(float("nan"))
    slots = torch.randperm(S, generator=g)[:B] if order == "scattered" else torch.arange(3, 3 + B)
    fresh = torch.rand(B, generator=g) < 0.3
    reused = slots[~fresh]
    cache.conv[:, reused] = torch.randn(cache.conv[:, reused].shape, generator=g)
    cache.recurrent[:, reused] = 0.3 * torch.randn(cache.recurrent[:, reused].shape, generator=g)
    start = [0 if f else int(torch.randint(1, 40, (1,), generator=g)) for f in fresh]
    ctx = ForwardContext.build(cache, [1] * B, start, slots.tolist(), [[0, 1, 2]] * B)
    return cache, ctx, torch.randn(B, config.hidden_size, generator=g), slots


@pytest.fixture
def op_calls(monkeypatch):
    """How many times the layer called the fused op."""
    return count_calls(monkeypatch, "kda_decode")


def layer_float64(layer, cache, ctx, x):
    """The layer's decode step in float64 (its products too), from the cache's states before the step."""
    lin = lambda m, v: F.linear(v, m.weight.double())   # noqa: E731
    x = x.double()
    i = dict(mixed=torch.cat([lin(m, x) for m in (layer.q_proj, layer.k_proj, layer.v_proj)], -1),
             f=lin(layer.f_b_proj, lin(layer.f_a_proj, x)), b=lin(layer.b_proj, x),
             gate=lin(layer.g_b_proj, lin(layer.g_a_proj, x)),
             conv_w=torch.cat([layer.q_conv1d.weight, layer.k_conv1d.weight, layer.v_conv1d.weight]).squeeze(1),
             dt_bias=layer.dt_bias, A_log=layer.A_log, norm_w=layer.o_norm.weight)
    si = layer.state_index
    y, _, rec = float64_reference(i, cache.conv[si], cache.recurrent[si], ctx.state_slots, ctx.fresh,
                                  layer.lower_bound, layer.o_norm.eps, layer.H, layer.dk)
    return lin(layer.o_proj, y), rec


@pytest.mark.parametrize("H,dk", [(1, 8), (3, 24), (2, 16), (4, 64)])
@pytest.mark.parametrize("B", [1, 5, 16, 64])
@pytest.mark.parametrize("lb", [-5.0, None])
@pytest.mark.parametrize("order", ["scattered", "consecutive"])
def test_layer_decode_fused_equals_its_eager_path(op_calls, H, dk, B, lb, order):
    config, layer = kda_layer(H, dk, lb, seed=H + dk)
    cache, ctx, x, slots = decode_batch(config, B, order, seed=B)
    y64, rec64 = layer_float64(layer, cache, ctx, x)
    ref, ref_conv, ref_rec = run_layer(layer, cache, ctx, x, fused=False)
    same, same_conv, same_rec = run_layer(layer, cache, ctx, x, fused=False, kda_only=True)
    assert not op_calls
    before = cache.conv.clone(), cache.recurrent.clone()
    got, conv, rec = run_layer(layer, cache, ctx, x)
    assert len(op_calls) == 1
    si, unused = layer.state_index, torch.ones(cache.conv.shape[1], dtype=torch.bool)
    unused[slots] = False
    others = [j for j in range(cache.conv.shape[0]) if j != si]                      # the other KDA layers
    for c, r in ((conv, rec), (ref_conv, ref_rec)):
        assert c[si, unused].isnan().all() and r[si, unused].isnan().all()           # never read, never written
        assert not c[si, slots].isnan().any() and not r[si, slots].isnan().any()     # fresh slots read as zero
        for now, then in ((c, before[0]), (r, before[1])):
            assert torch.equal(now[others].nan_to_num(7.0), then[others].nan_to_num(7.0))
    assert not got.isnan().any()
    # float32 rounding: 1e-6, or a few times the eager path's own error where the case is ill-conditioned
    # (a head's output q^T S cancels; with 8 values a batch's RMS does not average it out)
    bound = max(1e-6, 4 * rel_rms(ref, y64))
    assert rel_rms(got, ref) <= bound and rel_rms(got, y64) <= bound
    assert rel_rms(rec[si, slots], ref_rec[si, slots]) <= 1e-6 and rel_rms(rec[si, slots], rec64) <= 1e-6
    assert rel_rms(conv[si, slots], ref_conv[si, slots]) <= 1e-6
    assert rel_rms(got, same) <= bound and rel_rms(rec[si, slots], same_rec[si, slots]) <= 1e-6
    assert torch.equal(conv[si, slots], same_conv[si, slots])     # the window holds the inputs themselves


def test_layer_takes_the_eager_path_when_watched_or_replaying(op_calls):
    config, layer = kda_layer(3, 24, -5.0)
    cache, ctx, x, _ = decode_batch(config, 4, "scattered")
    ref = run_layer(layer, cache, ctx, x, fused=False)[0]
    seen = []
    hook = layer.o_norm.register_forward_hook(lambda m, i, o: seen.append(o))
    out = run_layer(layer, cache, ctx, x)[0]
    hook.remove()
    assert not op_calls and len(seen) == 1 and rel_rms(out, ref) <= 1e-6    # the probe sees the norm run
    ctx.replay = {0: KDARecord("replay")}     # a speculative row keeps its state: the eager step records it
    run_layer(layer, cache, ctx, x)
    assert not op_calls and 0 in ctx.replay[0].layers
    ctx.replay = None
    run_layer(layer, cache, ctx, x)
    assert len(op_calls) == 1


# ---- the engine: greedy decoding on the built-in tiny model ----

def test_engine_decode_with_the_fused_step_equals_the_eager_one(tiny_checkpoint, op_calls, monkeypatch):
    rng = random.Random(5)
    V = PRESETS["tiny"].vocab_size
    prompts = [[rng.randrange(1, V) for _ in range(n)] for n in (3, 29, 17, 50, 8, 33)]
    with kernels.eager_only():
        eager_all = run_engine(tiny_checkpoint, prompts, {}, tokens=12)
    with monkeypatch.context() as m:
        m.setattr(fk, "can", lambda *t: False)
        eager_kda = run_engine(tiny_checkpoint, prompts, {}, tokens=12)     # every other fused op on
    assert not op_calls
    fused = run_engine(tiny_checkpoint, prompts, {}, tokens=12)
    assert len(op_calls) >= 3 * 11                # every KDA layer of every decode step
    for (t, lg), (t_all, lg_all), (t_kda, lg_kda) in zip(fused, eager_all, eager_kda):
        assert t == t_all == t_kda
        assert rel_rms(lg, lg_kda) <= 1e-6
        # against everything eager, the other fused families' rounding adds (~8e-7 here on its own;
        # tests/native/test_fused_step.py holds all of them together to their bar)
        assert rel_rms(lg, lg_all) <= 2e-6
