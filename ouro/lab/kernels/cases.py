"""The kernels probe's registry: for each op, fresh random inputs shaped by a model config, the
fast function (looked up where the model calls it, so a patched op is the one tested), the naive
reference it must match, the FLOPs and bytes a call must at least cost, and its launch parameters.

A case's `check` returns an error (relative RMS, or the fraction of rows whose selection differs),
or a dict of errors per output (e.g. output and final state); NaN or a wrong shape counts as
infinitely wrong."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from ...ops.conv1d import causal_conv1d_naive
from ...ops.dsa import absorb_weights, index_select_naive, sparse_mla_naive
from ...ops.kda import kda_naive
from ...ops.mhc import sinkhorn_naive
from ...ops.moe import experts_naive
from .refs import F32, pool_keys_naive, rel_rms, route_naive, rows_to_check


@dataclass
class KernelCase:
    name: str
    file: str                       # repo-relative home of the fast op
    function: str
    calls: tuple[str, str]          # (module, global) through which the model calls the fast op
    phases: tuple[str, ...]
    make: Callable                  # (cfg, phase, gen) -> dict of inputs
    run: Callable                   # (fast_fn, inputs, **params) -> output
    check: Callable                 # (output, inputs, cfg, phase) -> error
    cost: Callable                  # (cfg, phase) -> (flops, bytes)
    params: dict = field(default_factory=dict)   # launch parameter -> default
    tol: float = 1e-4
    fresh: Callable | None = None   # (inputs, gen) -> new activations, weights kept (None: make anew)

    def fast(self):
        return getattr(importlib.import_module(self.calls[0]), self.calls[1])


# ------------------------------------------------------------------ KDA: chunked prefill, decode step
def _kda_inputs(cfg, N, T, gen):
    H, dk = cfg.linear_num_heads, cfg.linear_head_dim
    shape = (N, T, H, dk) if T else (N, H, dk)
    q = F.normalize(torch.randn(shape, generator=gen), dim=-1) * dk ** -0.5
    k = F.normalize(torch.randn(shape, generator=gen), dim=-1)
    v = torch.randn(shape, generator=gen)
    g = cfg.linear_lower_bound * torch.sigmoid(torch.randn(shape, generator=gen)) if cfg.linear_lower_bound \
        else -F.softplus(torch.randn(shape, generator=gen))
    beta = torch.sigmoid(torch.randn(shape[:-1], generator=gen))
    return dict(q=q, k=k, v=v, g=g, beta=beta, state=torch.randn(N, H, dk, dk, generator=gen) * 0.1)


def _kda_chunk_check(out, x, cfg, ph):
    o_ref, s_ref = kda_naive(x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"])
    return {"output": rel_rms(out[0], o_ref), "final_state": rel_rms(out[1], s_ref)}


def _kda_step_check(out, x, cfg, ph):
    o_ref, s_ref = kda_naive(*(x[n].unsqueeze(1) for n in ("q", "k", "v", "g", "beta")), x["state"])
    return {"output": rel_rms(out[0], o_ref[:, 0]), "state_in_place": rel_rms(out[1], s_ref)}


def _kda_step_run(fn, x):
    state = x["state"].clone()            # updated in place: the caller's copy stays the reference's
    return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], state), state


def _kda_cost(cfg, ph):  # per token and head: decay, recall, update, read of a dk x dv state
    H, d = cfg.linear_num_heads, cfg.linear_head_dim
    return 7 * ph.rows * H * d * d, F32 * (ph.rows * H * (4 * d + 1) + 2 * ph.batch * H * d * d)


# ------------------------------------------------------------------ causal depthwise conv
def _conv_inputs(cfg, ph, gen):
    C, K = 3 * cfg.linear_dim, cfg.linear_conv_kernel_dim
    T = ph.rows // ph.batch
    B = ph.batch if T == 1 else 2          # a prefill pair: the second sequence is shorter, padded
    lengths = torch.tensor([T] * B if T == 1 else [T, T - T // 3])
    x = torch.randn(B, C, T, generator=gen)
    for b, n in enumerate(lengths.tolist()):
        x[b, :, n:] = float("nan")         # padding must never reach a real output or the window
    return dict(x=x, weight=torch.randn(C, K, generator=gen) / K ** 0.5,
                conv_state=torch.randn(B, C, K - 1, generator=gen), lengths=lengths)


def _conv_check(out, x, cfg, ph):
    o_ref, s_ref = causal_conv1d_naive(x["x"], x["weight"], x["conv_state"], x["lengths"])
    if not isinstance(out, tuple) or out[0].shape != o_ref.shape:
        return float("inf")
    errs = [rel_rms(out[0][b, :, :n], o_ref[b, :, :n]) for b, n in enumerate(x["lengths"].tolist())]
    return {"output": max(errs), "window": rel_rms(out[1], s_ref)}


def _conv_cost(cfg, ph):
    C, K = 3 * cfg.linear_dim, cfg.linear_conv_kernel_dim
    return 2 * ph.rows * C * K, F32 * (2 * ph.rows * C + C * K + 2 * ph.batch * C * (K - 1))


# ------------------------------------------------------------------ DSA: pool keys, indexer, sparse MLA
def _pool_inputs(cfg, ph, gen):
    d, kp = cfg.index_head_dim, cfg.index_kpool
    n = ph.context // kp * kp
    return dict(keys=torch.randn(n, d, generator=gen), gate_scores=torch.randn(n, d, generator=gen),
                ape=torch.randn(kp, d, generator=gen))


def _index_inputs(cfg, ph, gen):
    Hi, d, kp = cfg.index_n_heads, cfg.index_head_dim, cfg.index_kpool
    L = ph.context
    per_seq = [_pool_inputs(cfg, ph, gen) for _ in range(1 if ph.name == "prefill" else ph.batch)]
    for s in per_seq:
        s["keys"] += 1.0                   # most q.k > 0: few exact-zero ReLU scores, so few ties
    pooled = [pool_keys_naive(s) for s in per_seq]
    q = torch.randn(ph.rows, Hi, d, generator=gen).abs()
    positions = torch.arange(L - ph.rows, L) if ph.name == "prefill" else \
        L - 1 - torch.arange(ph.batch) * (kp + 1) % max(1, L // 2)   # decode rows see different pool counts
    return dict(q=q, weights=torch.rand(ph.rows, Hi, generator=gen) + 0.1,
                pooled=pooled[0] if ph.name == "prefill" else torch.stack(pooled), positions=positions,
                raw=per_seq, select_k=cfg.index_topk // kp, kpool=kp, scale=d ** -0.5,
                width=cfg.index_topk + kp - 1)


def _index_run(fn, x):
    return fn(x["q"], x["weights"], x["pooled"], x["positions"], x["select_k"], x["kpool"], x["scale"], x["width"])


def _index_check(out, x, cfg, ph):
    if not isinstance(out, torch.Tensor) or out.shape != (x["q"].shape[0], x["width"]):
        return float("inf")
    rows, wrong = rows_to_check(out.shape[0]), 0
    for i in rows:
        raw = x["raw"][0 if ph.name == "prefill" else i]
        ref = index_select_naive(x["q"][i:i + 1], x["weights"][i:i + 1], raw["keys"], raw["gate_scores"], raw["ape"],
                                 x["positions"][i:i + 1], x["select_k"], x["kpool"], x["scale"])[0]
        wrong += sorted(t for t in out[i].tolist() if t >= 0) != ref
    return wrong / len(rows)               # fraction of rows whose selection differs


def _index_cost(cfg, ph):
    P, Hi, d = ph.context // cfg.index_kpool, cfg.index_n_heads, cfg.index_head_dim
    seqs = 1 if ph.name == "prefill" else ph.batch
    return 2 * ph.rows * Hi * d * P + 2 * ph.rows * Hi * P, F32 * (seqs * P * d + ph.rows * Hi * (d + 1)) \
        + 8 * ph.rows * (cfg.index_topk + cfg.index_kpool - 1)


def _mla_inputs(cfg, ph, gen):
    H, qk, v, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    L, W, n = ph.context, cfg.index_topk + cfg.index_kpool - 1, ph.rows
    seqs = 1 if ph.name == "prefill" else ph.batch
    latents = torch.randn(seqs * L, r, generator=gen)
    pos = torch.arange(L - n, L) if ph.name == "prefill" else torch.full((n,), L - 1)
    base = torch.zeros(n, dtype=torch.long) if ph.name == "prefill" else torch.arange(n) * L
    # each row sees a random subset of its causal prefix (all of it when it has fewer than W tokens)
    score = torch.rand(n, L, generator=gen).masked_fill(torch.arange(L)[None] > pos[:, None], -1.0)
    top = score.topk(min(W, L), dim=-1)
    sel = (top.indices + base[:, None]).masked_fill(top.values < 0, -1)
    dense = ph.name == "prefill" and L // cfg.index_kpool <= cfg.index_topk // cfg.index_kpool
    kv_b = torch.randn(H * (qk + v), r, generator=gen) * r ** -0.5
    return dict(q=torch.randn(n, H, qk, generator=gen), latents=latents, selected=None if dense else sel,
                causal=sel, kv_b=kv_b, scale=qk ** -0.5, absorbed=absorb_weights(kv_b, H, qk, v))


def _mla_run(fn, x, block=256):
    return fn(x["q"], x["latents"], x["selected"], *x["absorbed"], x["scale"], block=block)


def _mla_check(out, x, cfg, ph):
    return rel_rms(out, sparse_mla_naive(x["q"], x["latents"], x["causal"], x["kv_b"], x["scale"]))


def _mla_cost(cfg, ph):
    H, qk, v, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    W = min(ph.context, cfg.index_topk + cfg.index_kpool - 1)
    read = ph.context if ph.name == "prefill" else ph.batch * W          # distinct latent rows
    return 2 * ph.rows * H * (qk * r + 2 * W * r + r * v), F32 * (read * r + H * (qk + v) * r + ph.rows * H * (qk + v))


# ------------------------------------------------------------------ MoE: routing, experts
def _route_inputs(cfg, ph, gen):
    E = cfg.n_routed_experts
    return dict(logits=torch.randn(ph.rows, E, generator=gen), bias=torch.randn(E, generator=gen) * 0.1, cfg=cfg)


def _route_run(fn, x):
    c = x["cfg"]
    return fn(x["logits"], x["bias"], c.num_experts_per_tok, c.n_group, c.topk_group, c.norm_topk_prob,
              c.routed_scaling_factor)


def _route_check(out, x, cfg, ph):
    w_ref, e_ref = route_naive(x["logits"], x["bias"], cfg)
    w, e = out
    if e.shape != e_ref.shape:
        return float("inf")
    e_sorted, order = e.sort(-1)
    er_sorted, order_ref = e_ref.sort(-1)
    same = (e_sorted == er_sorted).all(-1)          # rows that chose the same experts
    weights = rel_rms(w.gather(1, order)[same], w_ref.gather(1, order_ref)[same]) if same.any() else 0.0
    return {"experts": 1.0 - same.float().mean().item(), "weights": weights}


def _experts_inputs(cfg, ph, gen):
    E, D, I, k = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    w = torch.rand(ph.rows, k, generator=gen) + 0.1
    return dict(x=torch.randn(ph.rows, D, generator=gen), weights=w / w.sum(-1, keepdim=True),
                experts=torch.rand(ph.rows, E, generator=gen).topk(k, dim=-1).indices,
                gate_up=torch.randn(E, 2 * I, D, generator=gen) * D ** -0.5,
                down=torch.randn(E, D, I, generator=gen) * I ** -0.5, limit=cfg.swiglu_limit)


def _experts_fresh(x, gen):
    T, k = x["experts"].shape
    w = torch.rand(T, k, generator=gen) + 0.1
    return {**x, "x": torch.randn(x["x"].shape, generator=gen), "weights": w / w.sum(-1, keepdim=True),
            "experts": torch.rand(T, x["gate_up"].shape[0], generator=gen).topk(k, dim=-1).indices}


def _experts_check(out, x, cfg, ph):
    rows = rows_to_check(x["x"].shape[0])
    ref = experts_naive(x["x"][rows], x["weights"][rows], x["experts"][rows], x["gate_up"], x["down"], x["limit"])
    return rel_rms(out[rows], ref) if isinstance(out, torch.Tensor) and out.shape == x["x"].shape else float("inf")


def _experts_cost(cfg, ph):
    E, D, I, k = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    active = min(E, ph.rows * k)           # weights of the experts the batch can touch are read once
    return 6 * ph.rows * k * D * I, F32 * (3 * active * D * I + 2 * ph.rows * D)


# ------------------------------------------------------------------ mHC: Sinkhorn
def _sinkhorn_inputs(cfg, ph, gen):
    n = cfg.hc_mult
    return dict(comb=torch.randn(ph.rows, n, n, generator=gen).softmax(-1) + cfg.hc_eps,
                iters=cfg.hc_sinkhorn_iters, eps=cfg.hc_eps)


def _sinkhorn_check(out, x, cfg, ph):
    rows = rows_to_check(x["comb"].shape[0])
    ref = torch.stack([sinkhorn_naive(x["comb"][i], x["iters"], x["eps"]) for i in rows])
    return rel_rms(out[rows], ref) if isinstance(out, torch.Tensor) and out.shape == x["comb"].shape else float("inf")


CASES: dict[str, KernelCase] = {c.name: c for c in [
    KernelCase("kda_chunk", "ouro/ops/kda/chunk.py", "kda_chunk", ("ouro.layers.context", "kda_chunk"), ("prefill",),
               lambda cfg, ph, gen: _kda_inputs(cfg, 1, ph.rows, gen),
               lambda fn, x, chunk=16: fn(x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"], chunk),
               _kda_chunk_check, _kda_cost, {"chunk": 16}),
    KernelCase("kda_recurrent_step", "ouro/ops/kda/recurrent.py", "kda_recurrent_step",
               ("ouro.layers.kda", "kda_recurrent_step"), ("decode",),
               lambda cfg, ph, gen: _kda_inputs(cfg, ph.batch, 0, gen), _kda_step_run, _kda_step_check, _kda_cost),
    KernelCase("causal_conv1d", "ouro/ops/conv1d.py", "causal_conv1d", ("ouro.layers.kda", "causal_conv1d"),
               ("prefill", "decode"), _conv_inputs,
               lambda fn, x: fn(x["x"], x["weight"], x["conv_state"], x["lengths"]), _conv_check, _conv_cost),
    KernelCase("pool_keys", "ouro/ops/dsa/indexer.py", "pool_keys", ("ouro.layers.dsa", "pool_keys"), ("prefill",),
               _pool_inputs, lambda fn, x: fn(x["keys"], x["gate_scores"], x["ape"]),
               lambda out, x, cfg, ph: rel_rms(out, pool_keys_naive(x)),
               lambda cfg, ph: (6 * ph.context * cfg.index_head_dim, F32 * 2 * ph.context * cfg.index_head_dim)),
    KernelCase("index_select", "ouro/ops/dsa/indexer.py", "index_select", ("ouro.layers.dsa", "index_select"),
               ("prefill", "decode"), _index_inputs, _index_run, _index_check, _index_cost, tol=0.0),
    # decode rows; a prefill (the probe's is past the indexer's top-k) runs sparse_mla_chunk
    KernelCase("sparse_mla", "ouro/ops/dsa/sparse_mla.py", "sparse_mla", ("ouro.layers.dsa", "sparse_mla"),
               ("decode",), _mla_inputs, _mla_run, _mla_check, _mla_cost, {"block": 256}),
    # a prefill chunk of one sequence, its selection as token positions
    KernelCase("sparse_mla_chunk", "ouro/ops/dsa/sparse_mla.py", "sparse_mla_chunk", ("ouro.layers.dsa", "sparse_mla_chunk"),
               ("prefill",), _mla_inputs,
               lambda fn, x, block=256: fn(x["q"], x["latents"], x["causal"], *x["absorbed"], x["scale"], block=block),
               _mla_check, _mla_cost, {"block": 256}),
    KernelCase("route", "ouro/ops/moe/routing.py", "route", ("ouro.layers.moe", "route"), ("prefill", "decode"),
               _route_inputs, _route_run, _route_check,
               lambda cfg, ph: (8 * ph.rows * cfg.n_routed_experts, F32 * 2 * ph.rows * cfg.n_routed_experts)),
    KernelCase("experts_grouped", "ouro/ops/moe/experts.py", "experts_grouped",
               ("ouro.layers.moe", "experts_grouped"), ("prefill", "decode"), _experts_inputs,
               lambda fn, x: fn(x["x"], x["weights"], x["experts"], x["gate_up"], x["down"], x["limit"]),
               _experts_check, _experts_cost, fresh=_experts_fresh),
    KernelCase("sinkhorn", "ouro/ops/mhc/sinkhorn.py", "sinkhorn", ("ouro.ops.mhc.sinkhorn", "sinkhorn"),
               ("prefill", "decode"), _sinkhorn_inputs, lambda fn, x: fn(x["comb"], x["iters"], x["eps"]),
               _sinkhorn_check,
               lambda cfg, ph: (4 * cfg.hc_sinkhorn_iters * ph.rows * cfg.hc_mult ** 2, F32 * 2 * ph.rows * cfg.hc_mult ** 2)),
]}
DEFAULT_OPS = tuple(CASES)
