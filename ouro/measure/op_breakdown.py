"""Where a compiled decode step's time goes, by the ops it calls, each group against its own floor.

`step_breakdown` times parts with module hooks, which need the eager forward: a step of tiny fused
ops then costs more in hooks than in arithmetic, and says little about the compiled step a user
runs. Here the engine's own compiled steps run under `torch.profiler`, which records each native op
the graph calls (`ouro_native::*`, `ouro_int8::*`: the C++ wrapper calls them through the
dispatcher) and torch's own; an op's self time goes to its group (`OP_GROUPS`, by name), and what
no recorded op took (the graph's generated loops, the wrapper, the engine around the step) to the
last row. Each element-wise group is set against the floor of its own work only (the KDA state read
and written, the latent rows read, the streams and the hyper-connections' weights, ...), the
products against their weights: `op_floors`.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

import torch

from .step_breakdown import MHC, part_floors, reach_decode
from .step_cost import LOW_PRECISION, ROUTED, SCALE, decode_cost, weight_tensors

KDA, DSA, INDEXER, SWIGLU = "KDA decode op", "DSA attention op", "DSA indexer op", "clamped SwiGLU"
ROUTED_ROW, PRODUCTS, SAMPLER = "routed experts (with their combine)", "projections and head", "sampler"
REST = "the rest (generated loops, wrapper, engine)"
# (op name prefix, group), first match wins
OP_GROUPS = (("ouro_native::kda", KDA), ("ouro_native::hc_", MHC), ("ouro_native::route", "router"),
             ("ouro_native::rms_norm", "norms"), ("ouro_native::gated_rms_norm", "norms"),
             ("ouro_native::sparse_mla", DSA), ("ouro_native::write_rows", DSA), ("ouro_native::index_", INDEXER), ("ouro_native::pool_keys", INDEXER),
             ("ouro_native::clamped_swiglu", SWIGLU), ("ouro_int8::w8a8_experts", ROUTED_ROW),
             ("ouro_native::moe_experts", ROUTED_ROW), ("ouro_native::pick_logprobs", SAMPLER),
             ("ouro_int8::", PRODUCTS), ("ouro_native::gemv", PRODUCTS), ("ouro_native::panel_linear", PRODUCTS),
             ("ouro_native::packed_linear", PRODUCTS), ("mkldnn::", PRODUCTS),
             ("aten::mm", PRODUCTS), ("aten::addmm", PRODUCTS), ("aten::_int_mm", PRODUCTS))
ROWS = [KDA, MHC, "router", "norms", DSA, INDEXER, SWIGLU, ROUTED_ROW, PRODUCTS, SAMPLER, REST]
ELEMENTWISE = (KDA, MHC, "router", "norms", DSA, INDEXER, SWIGLU)
# profiler events that wrap other ops (their self time is the wrapper's, counted in REST)
_WRAPPERS = ("## Call CompiledFxGraph", "ouro::opaque_call", "AOTDispatcher")


def group_of(name: str) -> str | None:
    return next((g for prefix, g in OP_GROUPS if name.startswith(prefix)), None)


def op_floors(model, context: int, batch: int, roof) -> dict:
    """{group: floor seconds} of a decode step of `batch` sequences at `context` tokens: each group's
    own work (`step_cost`'s terms and `part_floors`' rows where a group's ops do all of a row's work)."""
    c = model.config
    cost = decode_cost(model, context, batch)
    f, cb = cost.parts["flops"], cost.parts["cache_bytes"]
    rows = part_floors(model, context, batch, roof)
    mlp_width = sum(c.intermediate_size if t == "dense" else c.n_shared_experts * c.moe_intermediate_size
                    for t in c.mlp_layer_types)
    act = model.embed_tokens.weight.element_size()
    out = {KDA: roof.floor_s(f["kda"], cb["kda_state"]), MHC: rows.get(MHC, 0.0), "router": rows.get("router", 0.0),
           "norms": rows.get("norms", 0.0), DSA: roof.floor_s(f["dsa"], cb["latent_read"] + cb["written"]),
           INDEXER: roof.floor_s(f["indexer"], cb["pool_keys_read"] + cb["pool_inputs_read"]),
           SWIGLU: roof.floor_s(0.0, batch * 3 * mlp_width * act),     # gate and up in, h out
           ROUTED_ROW: rows.get("routed experts", 0.0) + rows.get("MoE combine", 0.0)}
    # the products: every weight but the routed experts', the hyper-connections', the norms' and the router gate's
    flops = low = nbytes = 0.0
    for name, w in weight_tensors(model).items():
        base = name.removesuffix(SCALE)
        if base.endswith(ROUTED) or "_hc." in base or "norm" in base.rsplit(".", 2)[-2] or ".mlp.gate." in base \
                or w is model.embed_tokens.weight or w.dim() < 2:
            continue
        nbytes += w.numel() * w.element_size()
        n = 0 if name.endswith(SCALE) else w.numel()
        flops += 2.0 * batch * n
        low += 2.0 * batch * n if w.dtype in LOW_PRECISION else 0.0
    out[PRODUCTS] = roof.floor_s(flops, nbytes, low)
    return out


def compiled_breakdown(engine, prompts: list[list[int]], steps: int, roof, params) -> dict:
    """The engine's compiled decode steps at batch len(prompts), `steps` of them under the profiler
    (after `steps` unprofiled ones, whose median is the step as run): per group the median ms a step
    and its floor. `params`: the requests' SamplingParams (enough tokens for 2 * steps + 2)."""
    from torch.profiler import ProfilerActivity, profile
    runner = getattr(engine, "runner", None)
    if getattr(runner, "graph", None) is None:
        raise ValueError("the compiled breakdown needs a compiled engine (--compile, or compile = true in --config)")
    model, batch = engine.model, len(prompts)
    reach_decode(engine, prompts, params)
    plain, contexts = [], []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        plain.append(time.perf_counter() - t)
    per_step = defaultdict(list)
    for _ in range(steps):
        contexts.append(statistics.mean(r.num_tokens for r in engine.scheduler.running))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            engine.step()
            total = time.perf_counter() - t
        spent = defaultdict(float)
        for e in prof.key_averages():
            group = None if e.key.startswith(_WRAPPERS) else group_of(e.key)
            if group is not None:
                spent[group] += e.self_cpu_time_total / 1e6
        spent[REST] = max(0.0, total - sum(spent.values()))
        for row in ROWS:
            per_step[row].append(spent.get(row, 0.0))
    while engine.has_unfinished():
        engine.step()
    context = round(statistics.mean(contexts))
    floors = op_floors(model, context, batch, roof)
    cost = decode_cost(model, context, batch)
    return {"batch": batch, "context": context, "compiled": True,
            "plain_step_ms": 1e3 * statistics.median(plain),
            "profiled_step_ms": 1e3 * statistics.median([sum(v[i] for v in per_step.values()) for i in range(steps)]),
            "floor_ms": 1e3 * roof.floor_s(cost.flops, cost.bytes, cost.parts["low_precision_flops"]),
            # the rates every floor comes from (a shared VM's copy rate moved 36-60 GB/s between runs)
            "rates": {"gflops": roof.flops_per_s / 1e9, "gb_per_s": roof.bytes_per_s / 1e9,
                      "low_gflops": roof.low_flops_per_s / 1e9 if roof.low_flops_per_s else None},
            "rows": [{"part": row, "ms": 1e3 * statistics.median(per_step[row]),
                      "floor_ms": 1e3 * floors[row] if row in floors else None} for row in ROWS]}


def _rates(r: dict | None) -> str:
    if not r:
        return "rates not recorded"
    low = f", low precision {r['low_gflops']:.0f} GFLOP/s" if r.get("low_gflops") else ""
    return f"{r['gflops']:.0f} GFLOP/s, {r['gb_per_s']:.1f} GB/s{low}"


def format_compiled(b: dict, target: float = 3.0) -> str:
    """The table `benchmarks/decode_breakdown.py --compiled` prints."""
    lines = [f"compiled decode step at batch {b['batch']}, context {b['context']}: {b['plain_step_ms']:.2f} ms as run, "
             f"{b['profiled_step_ms']:.2f} ms under the profiler, against a floor of {b['floor_ms']:.2f} ms "
             f"({b['plain_step_ms'] / b['floor_ms']:.1f}x; floors at {_rates(b.get('rates'))}). "
             "By op group (self time, medians):",
             "| group | ms | its floor, ms | x its floor | element-wise |", "|---|---|---|---|---|"]
    for r in b["rows"]:
        f = r["floor_ms"]
        ratio = f"{r['ms'] / f:.1f}" if f else "-"
        mark = "" if r["part"] not in ELEMENTWISE else "no floor" if not f else \
            "within" if r["ms"] <= target * f else "over"
        lines.append(f"| {r['part']} | {r['ms']:.3f} | {f'{f:.3f}' if f is not None else '-'} | {ratio} | {mark} |")
    return "\n".join(lines)
