"""The KDA decode step as one native op (`ouro/native/kda.cpp`) against the eager pieces it
replaces (conv step, L2 norms, forget gate, recurrent step, gated RMSNorm) and a float64 reference
written out here, on every path this machine runs: states updated in place in their slots only."""

import math

import pytest
import torch
import torch.nn.functional as F

from ouro.layers.kda import l2_normalize
from ouro.layers.norm import GatedRMSNorm
from ouro.native import kda as fk
from ouro.native import kernels
from ouro.ops.conv1d import causal_conv1d
from ouro.ops.kda import kda_recurrent_step


def rel_rms(a, b):
    return float((a.double() - b.double()).square().mean().sqrt() / b.double().square().mean().sqrt())


def case(T, H, dk, K, S, seed=0):
    g = torch.Generator().manual_seed(seed)
    C = H * dk
    r = lambda *s, scale=1.0: torch.randn(*s, generator=g) * scale   # noqa: E731
    inputs = dict(mixed=r(T, 3 * C), f=r(T, C), b=r(T, H), gate=r(T, C), conv_w=r(3 * C, K, scale=0.5),
                  dt_bias=r(C, scale=0.3), A_log=r(H, scale=0.5), norm_w=1 + r(dk, scale=0.2))
    conv = r(S, 3 * C, K - 1)
    rec = r(S, H, dk, dk, scale=0.3)
    slots = torch.randperm(S, generator=g)[:T]                      # any order, not consecutive
    fresh = torch.rand(T, generator=g) < 0.3
    return inputs, conv, rec, slots, fresh


def gate_of(f, dt_bias, A_log, lb, H, dk):
    raw = (f + dt_bias).view(-1, H, dk)
    rate = A_log.exp().view(1, H, 1)
    return lb * torch.sigmoid(rate * raw) if lb is not None else -rate * F.softplus(raw)


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


def float64_reference(i, conv, rec, slots, fresh, lb, eps, H, dk):
    d = {n: t.double() for n, t in i.items()}
    T = d["mixed"].shape[0]
    cs, rs = conv[slots].double().clone(), rec[slots].double().clone()
    cs[fresh], rs[fresh] = 0.0, 0.0
    full = torch.cat([cs, d["mixed"][:, :, None]], -1)
    act = F.silu((full * d["conv_w"]).sum(-1))
    q, k, v = (t.reshape(T, H, dk) for t in act.chunk(3, dim=-1))
    q = q / (q.square().sum(-1, keepdim=True) + 1e-6).sqrt() / math.sqrt(dk)
    k = k / (k.square().sum(-1, keepdim=True) + 1e-6).sqrt()
    g = gate_of(d["f"], d["dt_bias"], d["A_log"], lb, H, dk).exp()
    beta = torch.sigmoid(d["b"])
    rs = rs * g[..., None]
    u = beta[..., None] * (v - torch.einsum("thk,thkv->thv", k, rs))
    rs = rs + k[..., None] * u[:, :, None, :]
    o = torch.einsum("thk,thkv->thv", q, rs)
    y = d["norm_w"] * o / (o.square().mean(-1, keepdim=True) + eps).sqrt() * torch.sigmoid(d["gate"].view(T, H, dk))
    return y.reshape(T, -1), full[..., 1:], rs


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


def test_bad_slots_and_shapes_are_refused():
    i, conv, rec, slots, fresh = case(2, 2, 8, 4, 4)
    args = lambda s: (i["mixed"], i["f"], i["b"], i["gate"], i["conv_w"], i["dt_bias"], i["A_log"], -5.0,  # noqa: E731
                      i["norm_w"], 1e-5, conv, rec, s, fresh)
    with pytest.raises(RuntimeError, match="outside"):
        fk.kda_decode(*args(torch.tensor([0, 4])))
    with pytest.raises(RuntimeError, match="shape"):
        fk.kda_decode(i["mixed"], i["f"][:, :-1], *list(args(slots))[2:])
