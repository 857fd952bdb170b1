"""Turn recorded steps (see `probe.py`) into findings: repeated computations, host syncs,
work against the floor per block, ops per module."""

from __future__ import annotations

import re
from collections import Counter, defaultdict

from ...measure.step_cost import ROUTED
from ..findings import Finding
from .module_floor import block_floors, block_of, recorded_by_block, weight_reads

# a repeat wasting more than this share of the step's est. time is a warning (any repeated matmul
# is); decode steps are launch-bound and what a CUDA graph captures, prefill is compute-bound
MATERIAL_SHARE = {"decode": 0.01, "prefill": 0.03}
# A block whose decode work is FAR_RATIO times its floor's is a warning whatever its share of the
# step, at any batch. Work is roofline time under the cost model: max(core bytes / B, matmul FLOPs /
# F) against the floor's max(bytes / B, FLOPs / F); core bytes are those of the ops that read weights
# (or copies of them), run matmuls or gather / scatter rows (`module_floor.core`), so FLOPs that the
# block's weight reads hide (the MoE's padded experts) and eager element-wise chains are not counted.
# Clean decode, contexts 64 and 256 (tiny, tiny-py, small; batch 1 / 4 / 16): at most 2.6x / 2.4x /
# 3.4x (batch 1: the MoE's gathered copy of its experts' weights; batch 16: `small`'s DSA gathering all
# index_topk + kpool - 1 selection slots at context 64); a weight copied through float64 per step: 6.7x.
FAR_RATIO = 4.0
# ... or whose matmul FLOPs are FAR_FLOPS times its floor's, hidden under its memory time or not (the
# MoE's padded experts do 6.6x at batch 4 on `small`, by design; K/V expanded per head over the cache: 17x)
FAR_FLOPS = 10.0
# all bytes (element-wise chains included) this many times the floor, when the excess is this share
# of the step's bytes: eager chains alone reach 2.7x at batch 1, 4.5x at 16 and 6.8x at 64 (tiny)
FLOOR_RATIO_BYTES, FLOOR_SHARE = 8.0, 0.02
# ... or one of whose weights it reads FAR_RATIO times that weight's floor (every byte of it once; of
# the routed experts, the experts the batch's tokens touch), whatever the rest of the block does: a
# block total dilutes a weight read 4x (every expert at batch-1 decode, E/k = 4 on tiny) with the
# weights read once beside it (3.1x the MoE block's work). Clean decode (tiny, tiny-py, small; batch 1
# / 4 / 16): at most 1x / 2.4x (`small`'s padded experts: all 32 read, 13.2 touched) / 1.1x.
GROWTH_RATIO = 4.0         # attention work growing with context this many times faster than its floor
TOP = 8
# syncs ouro had when this probe was written (file, function): still reported, ranked after new ones
# ("info" would make a clean ouro warning-free; the lead decides once the two are fixed or accepted)


def _where(frame, module=None, op=None):
    file, function, line = frame
    return {"file": file, "function": function, "line": line, "module": module, "op": op}


def _origin(instances):
    """The frame where the repeated instances' call stacks part (the caller that repeats the work);
    the innermost frame when they never part (a loop, or the same call in several layers)."""
    stacks = [o.stack for o in instances]
    for d in range(min(len(s) for s in stacks)):
        if len({s[d] for s in stacks}) > 1:
            return stacks[1][d]
    return instances[0].frame


def _kind(block: str) -> str:
    """layers.3.self_attn -> layers.*.self_attn: the same code in every layer is one finding."""
    return re.sub(r"^layers\.\d+\.", "layers.*.", block)


def _depends_on(ops, later, earlier) -> bool:
    """Does op `later` (transitively) read what op `earlier` wrote? Then the repeat is an iteration
    feeding itself (a loop that reached its fixed point or cycle), not a recomputation."""
    seen, todo = set(), [later.index]
    while todo:
        i = todo.pop()
        for j in ops[i].inputs_from:
            if j == earlier.index:
                return True
            if j > earlier.index and j not in seen:
                seen.add(j)
                todo.append(j)
    return False


def repeat_findings(step, cost) -> list[Finding]:
    step_time = sum(cost.op_time(o) for o in step.ops if o.compute) or 1e-9
    groups = defaultdict(list)
    for o in step.ops:
        if o.compute and o.key is not None and (o.flops or o.bytes):
            groups[o.key].append(o)
    merged = defaultdict(lambda: {"waste": 0.0, "flops": 0.0, "bytes": 0.0, "groups": [], "matmul": False})
    for inst in groups.values():
        if len(inst) < 2:
            continue
        o, n = inst[0], len(inst)
        converged = _depends_on(step.ops, inst[1], inst[0])
        origin = _origin(inst)
        # one finding per source file and set of blocks: a repeated call shows as many op groups
        m = merged[(converged, origin[0], frozenset(_kind(block_of(i.module)) for i in inst))]
        m["waste"] += (n - 1) * cost.op_time(o)
        m["flops"] += (n - 1) * o.flops
        m["bytes"] += (n - 1) * o.bytes
        m["matmul"] |= o.matmul_flops > 0
        m["groups"].append((n, o, origin, sorted({i.module for i in inst})))
    out = []
    for (converged, file, _), m in sorted(merged.items(), key=lambda kv: -kv[1]["waste"]):
        n, o, origin, modules = max(m["groups"], key=lambda g: (g[1].matmul_flops, (g[0] - 1) * g[1].bytes))
        function = origin[1]
        share = m["waste"] / step_time
        mods = sorted({x for g in m["groups"] for x in g[3]})
        table = [[g[0], g[1].op, f"{g[1].frame[0]}:{g[1].frame[2]}", ",".join(g[3][:3])]
                 for g in sorted(m["groups"], key=lambda g: -(g[0] - 1) * cost.op_time(g[1]))[:TOP]]
        evidence = {"step": step.label, "repeated_groups": len(m["groups"]), "modules": mods[:TOP],
                    "groups (count, op, issued at, modules)": table}
        if converged:
            out.append(Finding("redundancy", "info",
                               f"{step.label}: {function}(): {len(m['groups'])} op(s) repeat on identical inputs that "
                               f"they produced themselves (an iteration at its fixed point, or coinciding values; "
                               f"{share:.0%} of the step's est. time)",
                               _where(origin, mods[0], o.op), measured={"wasted_share": share},
                               evidence=evidence, next="stop the iteration earlier only if the reference allows it"))
            continue
        severe = share > MATERIAL_SHARE[step.label.split("@")[0]] or m["matmul"]
        cross = len(mods) > 1 and all(len(g[3]) > 1 for g in m["groups"])
        what = "in every layer on the same forward-context tensors" if cross else f"{n}x on identical inputs"
        out.append(Finding(
            "redundancy", "warning" if severe else "info",
            f"{step.label}: {function}() recomputes {len(m['groups'])} op(s) {what} "
            f"(largest: aten.{o.op} x{n}; {share:.1%} of the step's est. time wasted)",
            _where(origin, modules[0], o.op),
            measured={"wasted_flops": m["flops"], "wasted_bytes": m["bytes"], "wasted_us": m["waste"] * 1e6,
                      "wasted_share": share},
            expected={"wasted_share": 0.0}, evidence=evidence,
            next=f"compute once and reuse: read {file}:{origin[2]} {function}()"))
    warn = [f for f in out if f.severity == "warning"]
    return warn + [f for f in out if f.severity == "info"][:5]


def sync_findings(decode, prefill) -> list[Finding]:
    out = []
    by_site = defaultdict(list)      # one finding per function: its syncs may sit on several lines
    for s in decode.syncs:
        if s.in_layer and s.blocking:
            by_site[s.frame[:2]].append(s)
    sites = sorted(by_site.items(), key=lambda kv: (-len(kv[1]), kv[1][0].kind != "item"))
    for site, syncs in sites:
        mods = sorted({s.module for s in syncs})
        kinds = Counter(s.kind for s in syncs)
        first = min(syncs, key=lambda s: s.frame[2])
        per_call = len(syncs) / max(1, len(mods))
        out.append(Finding(
            "redundancy", "warning",
            f"{decode.label}: {len(syncs)} host sync(s) per step inside the layers' decode path in {site[1]}() "
            f"({', '.join(f'{k} x{n}' for k, n in kinds.items())}; {len(mods)} module(s))",
            _where(first.frame, mods[0], first.kind.split(":")[-1].split("[")[0]),
            measured={"syncs_per_step": len(syncs), "per_module_call": per_call},
            expected={"syncs_per_step": 0},
            evidence={"modules": mods[:TOP], "lines": sorted({s.frame[2] for s in syncs}),
                      "stack": [f"{f}:{l} {fn}()" for f, fn, l in first.stack[:4]]},
            next="keep the value on the device (or take it from the host-side batch metadata) so the step can be graph-captured"))
    rest = Counter()
    for step in (decode, prefill):
        for s in step.syncs:
            if not (step is decode and s.in_layer and s.blocking):
                rest[(step.label, s.kind, s.module if s.in_layer else "(driver)", f"{s.frame[0]}:{s.frame[2]} {s.frame[1]}")] += 1
    if rest:
        table = [[*k, n] for k, n in rest.most_common(12)]
        out.append(Finding("redundancy", "info",
                           f"{sum(rest.values())} other host syncs / host-tensor copies (driver, prefill, torch.tensor from lists)",
                           {}, measured={"count": sum(rest.values())},
                           evidence={"(step, kind, module, site, count)": table}))
    return out


def _weights_by_block(model, step, batch) -> dict[str, list]:
    """{block: [(read / floor, parameter name, bytes read, floor, the op that read most of it)]}."""
    out = defaultdict(list)
    if model is None:
        return out
    for name, (nbytes, floor, op) in weight_reads(model, step.ops, batch).items():
        if floor > 0:
            out[block_of(name.rsplit(".", 1)[0])].append((nbytes / floor, name, nbytes, floor, op))
    for v in out.values():
        v.sort(key=lambda t: -t[0])
    return out


def floor_findings(model, decodes, batch, cost) -> list[Finding]:
    per_step = []
    for step in decodes:
        rec = recorded_by_block(step.ops)
        floors = block_floors(model, step.context, batch, step.io_bytes)
        per_step.append((step, rec, floors))
    weights = {step.label: _weights_by_block(model, step, batch) for step in decodes}
    out, table = [], []
    (s1, rec1, fl1), (s2, rec2, fl2) = per_step[0], per_step[-1]
    tot = {s.label: (sum(b.flops for b in r.values()) or 1.0, sum(b.bytes for b in r.values()) or 1.0)
           for s, r, _ in per_step}
    for blk in rec2:
        if blk not in fl2 or blk not in rec1:
            continue
        reasons, excess, compute, reader = [], 0.0, False, None
        for step, rec, fl in per_step:
            r, (ff, fb) = rec[blk], fl[blk]
            for ratio, name, nbytes, floor, op in weights[step.label].get(blk, ()):
                if ratio >= FAR_RATIO:
                    once = "the experts its tokens chose, once" if name.endswith(ROUTED) else "every byte once"
                    reasons.append(f"{step.label}: it reads {name} {ratio:.1f}x its floor ({nbytes:.3g} B against "
                                   f"{floor:.3g} B: {once})")
                    excess = max(excess, (nbytes - floor) / cost.bytes_per_s)
                    reader = reader or op
            t, t_floor, bound_by_flops = _work(r, ff, fb, cost)
            if t >= FAR_RATIO * t_floor:
                reasons.append(f"{step.label}: {t / t_floor:.1f}x its floor's work "
                               f"({'matmul FLOPs' if bound_by_flops else 'bytes of weights, cache rows and matmuls'})")
                excess, compute = max(excess, t - t_floor), compute or bound_by_flops
            elif ff > 0 and r.flops >= FAR_FLOPS * ff:
                reasons.append(f"{step.label}: {r.flops / ff:.1f}x its floor FLOPs")
                excess, compute = max(excess, (r.flops - ff) / cost.flops_per_s), True
            if r.bytes > FLOOR_RATIO_BYTES * fb and (r.bytes - fb) > FLOOR_SHARE * tot[step.label][1]:
                reasons.append(f"{step.label}: {r.bytes / fb:.1f}x its floor bytes")
                excess = max(excess, (r.bytes - fb) / cost.bytes_per_s)
        grow = {}
        # only attention's work may depend on the context; elsewhere two steps differ by routing alone
        for kind, idx in (("bytes", 1), ("flops", 0)) if blk.endswith("self_attn") else ():
            d_rec = getattr(rec2[blk], kind) - getattr(rec1[blk], kind)
            d_floor = fl2[blk][idx] - fl1[blk][idx]
            allowed = GROWTH_RATIO * max(d_floor, 0.05 * fl1[blk][idx])
            grow[kind] = (d_rec, d_floor)
            if d_rec > allowed and d_rec > FLOOR_SHARE * tot[s2.label][idx]:
                reasons.append(f"{kind} grow by {d_rec:.3g} from context {s1.context} to {s2.context}, floor by {d_floor:.3g}")
                excess = max(excess, d_rec / (cost.flops_per_s if kind == "flops" else cost.bytes_per_s))
        r2 = rec2[blk]
        t, t_floor, _ = _work(r2, *fl2[blk], cost)
        w2 = weights[s2.label].get(blk)
        table.append([blk, r2.ops, round(t / t_floor, 2), round(r2.bytes / max(fl2[blk][1], 1), 2),
                      round(r2.flops / fl2[blk][0], 2) if fl2[blk][0] else None, round(w2[0][0], 2) if w2 else None])
        if not reasons:
            continue
        if reader is not None:      # a weight read far past its floor: the op that read it
            top = reader
        elif (compute or any("flops" in x for x in reasons)) and r2.top_flops:
            top = r2.top_flops
        else:
            top = r2.top_core if any("floor's work" in x for x in reasons) and r2.top_core else r2.top_bytes
        out.append((excess, Finding(
            "redundancy", "warning", f"{blk} does far more decode work than its floor: {reasons[0]}"
            + ("; its work grows with context much faster than the floor" if any("grow" in x for x in reasons) else ""),
            _where(top.frame, top.module, top.op),
            measured={"bytes": r2.bytes, "flops": r2.flops, "growth": grow, "wasted_us": excess * 1e6},
            expected={"floor_bytes": fl2[blk][1], "floor_flops": fl2[blk][0]},
            evidence={"reasons": reasons, "costliest_op": f"aten.{top.op} at {top.frame[0]}:{top.frame[2]} "
                      f"({top.bytes:.3g} B, {top.matmul_flops:.3g} FLOPs)"},
            next=f"ouro probe kernels, or read {top.frame[0]}:{top.frame[2]} {top.frame[1]}()")))
    findings = [f for _, f in sorted(out, key=lambda t: -t[0])]
    table.sort(key=lambda r: -(r[2] or 0))
    findings.append(Finding("redundancy", "info",
                            f"{s2.label}: recorded work against the floor per block (highest: {table[0][0]}, "
                            f"{table[0][2]}x; a warning from {FAR_RATIO:g}x)",
                            {"module": table[0][0]},
                            evidence={"(block, ops, work/floor, bytes/floor, flops/floor, most-read weight/floor)":
                                      table[:TOP]}))
    return findings


def _work(r, floor_flops, floor_bytes, cost) -> tuple[float, float, bool]:
    """(the block's roofline time, its floor's, whether FLOPs bound it): see FAR_RATIO."""
    t_bytes, t_flops = r.core_bytes / cost.bytes_per_s, r.flops / cost.flops_per_s
    t_floor = max(floor_bytes / cost.bytes_per_s, floor_flops / cost.flops_per_s, 1e-30)
    return max(t_bytes, t_flops), t_floor, t_flops > t_bytes


def op_count_finding(decode, prefill, cost) -> Finding:
    tables = {}
    for step in (decode, prefill):
        c = Counter(block_of(o.module) for o in step.ops if o.compute)
        tables[step.label] = {"total": sum(c.values()), "top": [[m, n] for m, n in c.most_common(TOP)]}
    n = tables[decode.label]["total"]
    return Finding("redundancy", "info",
                   f"{decode.label}: {n} aten ops dispatched per step "
                   f"(~{n * cost.op_overhead_s * 1e3:.1f} ms of launch overhead at {cost.op_overhead_s * 1e6:.1f} us/op)",
                   {"module": tables[decode.label]["top"][0][0] if tables[decode.label]["top"] else None},
                   measured={"ops_per_step": n}, evidence=tables,
                   next="fewer, larger ops (fusion) or a CUDA graph of the decode step")
