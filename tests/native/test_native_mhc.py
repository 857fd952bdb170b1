"""Fused mHC ops (`ouro/native/mhc.cpp`): hc_pre, hc_post and hc_post_pre against the eager
hyper-connection (float32 and float64), on every path this machine has; batch invariance; the
model's cross-layer fusion against the eager model, and off where a hook watches."""

import types

import pytest
import torch

from tests.helpers.numerics import rel_rms
from ouro.layers.mhc import HyperConnection
from ouro.native import kernels
from ouro.native import mhc as fused
from ouro.ops.mhc import sinkhorn

pytestmark = pytest.mark.skipif(not kernels.load("mhc"), reason=f"mhc kernels not built: {kernels.why_not('mhc')}")

NORM_EPS, HC_EPS = 1e-2, 1e-3      # large enough that every eps term shows in the results


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():      # the fused path is for inference: under autograd the module runs eager
        yield


@pytest.fixture(params=["native", "portable"])
def path(request):
    if request.param == "portable":
        with kernels.portable("mhc"):
            yield request.param
    else:
        yield request.param


def hc(n, D, iters, seed):
    """A hyper-connection with random fn, base and scale (none left at its initial value)."""
    cfg = types.SimpleNamespace(hc_mult=n, hidden_size=D, rms_norm_eps=NORM_EPS, hc_eps=HC_EPS, hc_sinkhorn_iters=iters)
    m = HyperConnection(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        m.fn.copy_(torch.randn(m.fn.shape, generator=g) * (n * D) ** -0.5)
        m.base.copy_(torch.randn(m.base.shape, generator=g))
        m.scale.copy_(torch.rand(3, generator=g) * 1.5 + 0.25)
    return m.eval()


def weights64(m, streams):
    """The hyper-connection's output computed in float64 throughout (`hc_weights` itself computes
    in float32 whatever its inputs)."""
    T, n, D = streams.shape
    s, fn, base, scale = streams.double(), m.fn.double(), m.base.double(), m.scale.double()
    flat = s.reshape(T, -1)
    z = (flat * (flat.square().mean(-1, keepdim=True) + NORM_EPS).rsqrt()) @ fn.T
    pre = torch.sigmoid(z[:, :n] * scale[0] + base[:n]) + HC_EPS
    post = 2 * torch.sigmoid(z[:, n:2 * n] * scale[1] + base[n:2 * n])
    comb = torch.softmax((z[:, 2 * n:] * scale[2] + base[2 * n:]).view(T, n, n), -1) + HC_EPS
    return (pre.unsqueeze(1) @ s).squeeze(1), post, sinkhorn(comb, m.iters, HC_EPS)


def poisoned_call(fn, *out_shapes):
    """Calls fn right after freeing NaN-filled blocks of its outputs' sizes, so memory an op
    allocates but never writes is likely to show as NaN."""
    blocks = [torch.full(s, float("nan")) for s in out_shapes]
    del blocks
    return fn()


def eager(fn):
    with kernels.eager_only():
        return fn()


def check(got, ref32, ref64, tol=1e-6):
    """Fused within tol of eager float32, and about as close to float64 as eager float32 is (plus a few
    float32 roundings: an output of 4 entries, such as a 2 x 2 comb, can sit 1e-8 from float64 in eager)."""
    for g, r32, r64 in zip(got, ref32, ref64):
        assert g.shape == r32.shape and g.dtype == torch.float32 and not torch.isnan(g).any()
        assert rel_rms(g, r32) <= tol, rel_rms(g, r32)
        assert rel_rms(g, r64) <= 2 * rel_rms(r32, r64) + 5e-7, (rel_rms(g, r64), rel_rms(r32, r64))


# T: one token, a short group, a full group of 8 and a short one after it (11), several groups
SHAPES = [(n, D, T, iters) for n in (1, 2, 3, 4) for D in (7, 64, 96) for T in (1, 3, 11, 16, 64) for iters in (1, 2, 20)]


@pytest.mark.parametrize("n,D,T,iters", SHAPES)
def test_hc_pre_matches_eager(path, n, D, T, iters):
    m = hc(n, D, iters, seed=n * 1000 + D * 10 + T)
    streams = torch.randn(T, n, D, generator=torch.Generator().manual_seed(T)) * 2
    ref32 = eager(lambda: m(streams))
    ref64 = weights64(m, streams)
    got = poisoned_call(lambda: fused.hc_pre(streams, *m._weights()), (T, D), (T, n), (T, n, n))
    check(got, ref32, ref64)
    assert all(torch.equal(a, b) for a, b in zip(m(streams), fused.hc_pre(streams, *m._weights())))  # the module's path


@pytest.mark.parametrize("n,D,T", [(n, D, T) for n in (1, 2, 4) for D in (7, 64, 96) for T in (1, 3, 16, 64)])
def test_hc_post_matches_eager(path, n, D, T):
    m = hc(n, D, 20, seed=T)
    g = torch.Generator().manual_seed(n + D + T)
    streams, out = torch.randn(T, n, D, generator=g), torch.randn(T, D, generator=g)
    _, post, comb = eager(lambda: m(torch.randn(T, n, D, generator=g)))
    ref32 = eager(lambda: m.mix(out, streams, post, comb))
    ref64 = eager(lambda: m.mix(out.double(), streams.double(), post.double(), comb.double()))
    got = poisoned_call(lambda: fused.hc_post(out, streams, post, comb), (T, n, D))
    check([got], [ref32], [ref64])
    assert torch.equal(m.mix(out, streams, post, comb), got)


@pytest.mark.parametrize("n,D,T,iters", SHAPES)
def test_hc_post_pre_matches_mix_then_forward(path, n, D, T, iters):
    a, b = hc(n, D, iters, seed=D + T), hc(n, D, iters, seed=D + T + 1)
    g = torch.Generator().manual_seed(7 * T + n)
    streams, out = torch.randn(T, n, D, generator=g), torch.randn(T, D, generator=g)
    _, post, comb = eager(lambda: a(torch.randn(T, n, D, generator=g)))

    def unfused(dt):
        new = a.mix(out.to(dt), streams.to(dt), post.to(dt), comb.to(dt))
        return (new, *(b(new) if dt == torch.float32 else weights64(b, new)))
    ref32, ref64 = eager(lambda: unfused(torch.float32)), eager(lambda: unfused(torch.float64))
    got = poisoned_call(lambda: fused.hc_post_pre(out, streams, post, comb, *b._weights()),
                        (T, n, D), (T, D), (T, n), (T, n, n))
    check(got, ref32, ref64)
    new, weights = a.mix_then(b, out, streams, post, comb)
    assert all(torch.equal(x, y) for x, y in zip((new, *weights), fused.hc_post_pre(out, streams, post, comb, *b._weights())))


@pytest.mark.parametrize("batch", [16, 64])
@pytest.mark.parametrize("n,D", [(4, 96), (1, 7), (2, 64)])
def test_a_token_alone_equals_it_in_a_batch(path, batch, n, D):
    """Each token's weights and mix are bit-identical computed alone and at any row of a batch, so
    deterministic mode (`batch_invariant`) takes the fused ops too."""
    a, b = hc(n, D, 20, seed=1), hc(n, D, 20, seed=2)
    g = torch.Generator().manual_seed(batch)
    streams, out = torch.randn(batch, n, D, generator=g), torch.randn(batch, D, generator=g)
    _, post, comb = a(torch.randn(batch, n, D, generator=g))
    whole = (*a(streams), a.mix(out, streams, post, comb), *a.mix_then(b, out, streams, post, comb)[1])
    for t in (0, 1, 5, 14, batch - 1):
        alone = (*a(streams[t:t + 1]), a.mix(out[t:t + 1], streams[t:t + 1], post[t:t + 1], comb[t:t + 1]),
                 *a.mix_then(b, out[t:t + 1], streams[t:t + 1], post[t:t + 1], comb[t:t + 1])[1])
        for w, one in zip(whole, alone):
            assert torch.equal(w[t:t + 1], one)


@pytest.mark.parametrize("T", [1, 2, 4, 7, 8])
def test_a_few_tokens_split_over_threads_equal_one_thread_and_a_batch(path, T):
    """Up to 8 tokens (one group) with a projection of 64 KB or more (`small`'s 196 KB) split its rows over the
    threads (`SPLIT_FLOATS`): bit-identical to one thread and to the same tokens in a batch of 16,
    for the weights alone and after a mix; within eager's tolerance."""
    n, D = 4, 512
    a, b = hc(n, D, 20, seed=3), hc(n, D, 20, seed=4)
    g = torch.Generator().manual_seed(T)
    streams, out = torch.randn(16, n, D, generator=g), torch.randn(16, D, generator=g)
    _, post, comb = a(torch.randn(16, n, D, generator=g))

    def both(rows):
        return (*fused.hc_pre(streams[rows], *a._weights()),
                *a.mix_then(b, out[rows], streams[rows], post[rows], comb[rows])[1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        split = both(slice(0, T))
        torch.set_num_threads(1)
        one = both(slice(0, T))
    finally:
        torch.set_num_threads(threads)
    batch = both(slice(0, 16))
    for s_, o, w in zip(split, one, batch):
        assert torch.equal(s_, o) and torch.equal(s_, w[:T]) and not torch.isnan(s_).any()
    check(split[:3], eager(lambda: a(streams[:T])), weights64(a, streams[:T]))


def test_the_ops_have_working_fakes():
    m, n = hc(2, 8, 3, seed=0), 2
    streams, out = torch.randn(5, n, 8), torch.randn(5, 8)
    _, post, comb = m(streams)
    torch.library.opcheck(torch.ops.ouro_native.hc_pre, (streams, *m._weights()))
    torch.library.opcheck(torch.ops.ouro_native.hc_post, (out, streams, post, comb))
    torch.library.opcheck(torch.ops.ouro_native.hc_post_pre, (out, streams, post, comb, *m._weights()))


def test_a_compiled_graph_holds_each_fused_op_as_one_call():
    a, b = hc(4, 16, 20, seed=0), hc(4, 16, 20, seed=1)
    seen = []

    def backend(gm, inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    def part(streams, out):
        x, post, comb = a(streams)
        new, weights = a.mix_then(b, out + x, streams, post, comb)
        x, post, comb = weights if weights is not None else b(new)
        return b.mix(out + x, new, post, comb)
    streams, out = torch.randn(3, 4, 16), torch.randn(3, 16)
    got = torch.compile(part, backend=backend, fullgraph=True)(streams, out)
    assert rel_rms(got, eager(lambda: part(streams, out))) <= 1e-6
    assert [t for t in seen if "ouro_native" in t] == ["ouro_native.hc_pre", "ouro_native.hc_post_pre",
                                                           "ouro_native.hc_post"], seen


# ---- the whole model: fused across layers vs eager ----

def tiny_model():
    from ouro.models.glm5_next import Glm5NextModel
    from ouro.models.presets import PRESETS
    torch.manual_seed(0)
    model = Glm5NextModel(PRESETS["tiny"])
    with torch.no_grad():
        for p in model.parameters():             # every weight random, the hyper-connections' too
            p.copy_(torch.randn_like(p) * 0.05)
        for layer in model.layers:
            for h in (layer.attn_hc, layer.ffn_hc):
                h.scale.copy_(torch.rand(3) + 0.5)
                h.base.copy_(torch.randn(h.base.shape))
    return model.eval()


def generate(model, prompts, steps):
    """Greedy decoding of a batch: (logits of every step, tokens)."""
    from ouro.engine.simple_runner import SimpleRunner
    runner = SimpleRunner(model, len(prompts), 128)
    logits, tokens = [runner.step(prompts)], []
    for _ in range(steps):
        tokens.append(logits[-1].argmax(-1))
        logits.append(runner.step([[int(t)] for t in tokens[-1]]))
    return torch.cat(logits), torch.stack(tokens) if tokens else None


def count_calls(monkeypatch):
    calls = []
    op = fused.hc_post_pre
    monkeypatch.setattr(fused, "hc_post_pre", lambda *a: calls.append(1) or op(*a))
    return calls


PROMPTS = [list(range(5, 75)), list(range(100, 103)), [9, 40, 41, 300]]


def test_fused_model_equals_the_eager_model(monkeypatch):
    model = tiny_model()
    calls = count_calls(monkeypatch)
    got, got_tokens = generate(model, PROMPTS, 6)
    L = len(model.layers)
    assert len(calls) == 7 * (2 * L - 1)       # attention's mix in every layer, the last mix in all but the last
    ref, ref_tokens = eager(lambda: generate(model, PROMPTS, 6))
    assert rel_rms(got, ref) <= 1e-6, rel_rms(got, ref)
    assert torch.equal(got_tokens, ref_tokens)


@pytest.mark.parametrize("where", ["layer", "attn_hc", "ffn_hc"])
def test_a_watched_module_runs_as_written(monkeypatch, where):
    """A hook on layer 1, its attn_hc or its ffn_hc turns off the fusions that would skip or cover
    it, and sees the module run; a passive hook changes nothing."""
    from ouro.layers.watch import passive
    model = tiny_model()
    layer = model.layers[1]
    target = {"layer": layer, "attn_hc": layer.attn_hc, "ffn_hc": layer.ffn_hc}[where]
    seen, calls = [], count_calls(monkeypatch)
    handle = target.register_forward_hook(lambda m, a, o: seen.append(1))
    got, _ = generate(model, PROMPTS[1:], 0)
    handle.remove()
    L = len(model.layers)
    # the layer watched: both of its boundaries run unfused (inside it, what it does is unseen);
    # its attn_hc or ffn_hc: the two mixes next to it
    assert len(calls) == 2 * L - 3 and seen == [1]
    assert rel_rms(got, eager(lambda: generate(model, PROMPTS[1:], 0))[0]) <= 1e-6
    calls.clear()
    handle = target.register_forward_hook(passive(lambda m, a, o: None))
    generate(model, PROMPTS[1:], 0)
    handle.remove()
    assert len(calls) == 2 * L - 1


@pytest.mark.parametrize("n", [fused.MAX_STREAMS, fused.MAX_STREAMS + 1])
def test_more_streams_than_the_kernel_holds_run_the_eager_code(n):
    """The kernel keeps an n x n matrix on the stack (n <= MAX_STREAMS): a model with more streams
    (a config transformers runs) takes the eager path at every call instead of failing in the op."""
    m, T, D = hc(n, 8, 3, seed=n), 5, 8
    streams = torch.randn(T, n, D, generator=torch.Generator().manual_seed(n))
    assert fused.can(streams, m.fn, m.base, m.scale) == (n <= fused.MAX_STREAMS)
    got = m(streams)
    post, comb = got[1], got[2]
    mixed = m.mix(got[0], streams, post, comb)
    ref = eager(lambda: m(streams))
    assert all(rel_rms(a, b) <= 1e-6 for a, b in zip(got, ref))
    assert rel_rms(mixed, eager(lambda: m.mix(got[0], streams, post, comb))) <= 1e-6
