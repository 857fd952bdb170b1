"""The native KDA tests' cases: random decode inputs, the float64 reference step, a KDA layer of the
tiny shape and its step on a copy of the cache (`native/test_native_kda.py`, `native/test_native_kda_prefill.py`)."""

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from ouro.layers.kda import KDAttention
from ouro.models.presets import PRESETS
from ouro.native import kda as fk
from ouro.native import kernels


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


def kda_layer(H, dk, lb, seed=0):
    config = replace(PRESETS["tiny"], linear_num_heads=H, linear_head_dim=dk, linear_lower_bound=lb)
    layer = KDAttention(config, config.kda_layers[0])
    g = torch.Generator().manual_seed(seed)
    for name, p in layer.named_parameters():
        scale = 1.0 if name.endswith("o_norm.weight") else 0.5 if "conv" in name or name == "A_log" else 0.2
        p.data = torch.randn(p.shape, generator=g) * (0.2 if "norm" in name else scale) + ("norm" in name)
    return config, layer


def count_calls(monkeypatch, op: str) -> list:
    """A list that gets an entry each time a layer calls `ouro.native.kda.<op>`."""
    calls = []
    real = getattr(fk, op)
    monkeypatch.setattr(fk, op, lambda *a: calls.append(1) or real(*a))
    return calls


def run_layer(layer, cache, ctx, x, fused=True, kda_only=False):
    """The layer's output and the cache's states after the step, on a copy of the cache's states."""
    conv, rec = cache.conv.clone(), cache.recurrent.clone()
    if not fused and kda_only:          # every other fused path (merged products) as in the fused run
        with pytest.MonkeyPatch.context() as m:
            m.setattr(fk, "can", lambda *t: False)
            out = layer._forward(x, ctx)
    else:
        with kernels.eager_only(not fused):
            out = layer._forward(x, ctx)
    after = cache.conv.clone(), cache.recurrent.clone()
    cache.conv.copy_(conv)
    cache.recurrent.copy_(rec)
    return out, *after
