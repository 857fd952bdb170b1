"""Helpers of the kernels probe's cases: the shape of a step, the error measure, which rows a slow
reference checks, and the naive references that `ouro/ops` does not have (pool keys one pool at a
time, routing with sorted Python lists)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

F32 = 4


@dataclass(frozen=True)
class Phase:
    """One step's shape: `rows` new tokens in `batch` sequences, each seeing `context` tokens."""
    name: str       # "prefill" or "decode"
    rows: int
    batch: int
    context: int


def rel_rms(a, b) -> float:
    if not isinstance(a, torch.Tensor) or a.shape != b.shape:
        return float("inf")
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all() or not torch.isfinite(b).all():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def rows_to_check(n: int, k: int = 32) -> list[int]:
    """A few rows, the last ones (longest context) always among them: naive references are slow."""
    return sorted(set(torch.linspace(0, n - 1, min(n, k // 2)).long().tolist()) | set(range(max(0, n - k // 2), n)))


def pool_keys_naive(x):
    """Compressed pool keys from a case's inputs (keys, gate_scores [P*kpool, d], ape [kpool, d])."""
    kp = x["ape"].shape[0]
    out = []
    for p in range(x["keys"].shape[0] // kp):   # one pool at a time: softmax over its tokens
        sl = slice(p * kp, (p + 1) * kp)
        out.append(((x["gate_scores"][sl] + x["ape"]).softmax(0) * x["keys"][sl]).sum(0))
    return torch.stack(out) if out else x["keys"].new_zeros(0, x["keys"].shape[1])


def route_naive(logits, bias, c):
    """Per token, with sorted Python lists: groups ranked by their two best biased scores."""
    E, G = logits.shape[1], max(1, c.n_group)
    out_w, out_e = [], []
    for row in logits.tolist():
        s = [1 / (1 + math.exp(-x)) for x in row]
        ch = [s[e] + float(bias[e]) for e in range(E)]
        per = E // G
        if G > 1:
            gs = [sum(sorted(ch[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(G)]
            keep = sorted(range(G), key=lambda g: (-gs[g], g))[:c.topk_group]
            allowed = [e for e in range(E) if e // per in keep]
        else:
            allowed = list(range(E))
        ex = sorted(allowed, key=lambda e: (-ch[e], e))[:c.num_experts_per_tok]
        w = [s[e] for e in ex]
        z = sum(w) + 1e-20 if c.norm_topk_prob else 1.0
        out_w.append([x / z * c.routed_scaling_factor for x in w])
        out_e.append(ex)
    return torch.tensor(out_w), torch.tensor(out_e)
