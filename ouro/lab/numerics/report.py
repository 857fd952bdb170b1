"""The numerics probe's findings (`probe.py` compares, this says what the comparison found):
the first divergence (where, which op, on which seam of the configuration, what to run next), how
far the logits agree, and a tensor-parallel run whose ranks fell out of step."""

from __future__ import annotations

import math

import torch

from ..findings import Finding
from .run_configs import PAGE_SIZE, Config, hit_tokens, pieces
from .taps import Recording
from .tolerances import ERROR_FACTOR

PROBE = "numerics"


def tp_findings(rec: Recording, cfg: Config) -> list[Finding]:
    """A tensor-parallel run whose ranks did not issue the same collectives (or stopped on one):
    no output of it can be trusted, so this is the finding, naming the module."""
    mismatch, errors = getattr(rec, "tp_mismatch", None), getattr(rec, "tp_errors", {})
    if not mismatch and not errors:
        return []
    if mismatch:
        src = _ouro_source(rec, mismatch["module"])
        where = {"module": mismatch["module"], "layer": _layer(mismatch["module"])}
        if src:
            where.update(file=src[0], function=src[1], line=src[2])
        return [Finding(PROBE, "error", f"{cfg}: rank(s) {mismatch['ranks_missing']} did not join the "
                        f"{mismatch['kind']} of {mismatch['module']} (collective #{mismatch['index']}); the ranks' "
                        "collectives were paired wrongly from there", where=where,
                        evidence={"collective per rank (kind, shape, module)": mismatch["seen"], "rank errors": errors},
                        next="check that every rank runs this module's collective (a rank-dependent branch skipping it)")]
    return [Finding(PROBE, "error", f"{cfg}: a rank stopped: {next(iter(errors.values()))}", evidence=errors,
                    next="run the configuration again with --b tp=1 to see whether the model itself fails")]


def _ouro_source(rec, key: str):
    """The source of `key`, or of its nearest enclosing module defined in ouro (an nn.Linear's
    forward is torch's: the finding names the ouro module that owns it)."""
    while key:
        src = rec.sources.get(key)
        if src and src[0].startswith("ouro/"):
            return src
        key = key.rpartition(".")[0]
    return None


def growth(positions, err) -> dict:
    """Does the error grow with position? mean(last quarter) / mean(first quarter), correlation."""
    e = err.double().clamp(max=1e30)
    q = max(1, len(e) // 4)
    first, last = float(e[:q].mean()), float(e[-q:].mean())
    p = torch.tensor(positions, dtype=torch.float64)
    corr = float(torch.corrcoef(torch.stack([p, e]))[0, 1]) if len(e) > 2 and e.std() > 0 else 0.0
    return {"last_vs_first_quarter": last / first if first > 0 else (math.inf if last > 0 else 1.0),
            "corr_with_position": round(corr, 3) if math.isfinite(corr) else 0.0}


def _layer(key: str):
    parts = key.split(".")
    return int(parts[1]) if len(parts) > 1 and parts[0] == "layers" and parts[1].isdigit() else None


def _suspect_op(ra: Recording, key: str) -> str | None:
    """The op whose output *is* the module's output on ouro's side (e.g. the router returning
    `route(...)`): when ouro is compared with transformers, that op is where to look."""
    mod = ra.stacked(key)
    for op_key in ra.ops:
        if op_key.rsplit(".", 1)[0] != key:
            continue
        got = ra.stacked(op_key)
        if mod and got and got[0] == mod[0] and got[1].shape == mod[1].shape and torch.equal(got[1], mod[1]):
            return op_key
    return None


# what crosses a context-parallel cut into the op that computed a row there
CP_EXCHANGE = {"causal_conv1d": "the short conv's halo (ouro/parallel/cp_kda.py conv_halo)",
               "kda_chunk": "the KDA state chain (ouro/parallel/cp_kda.py kda_context_parallel)",
               "index_select": "the all-gathered indexer rows and pools (ouro/parallel/cp_context.py)",
               "sparse_mla": "the all-gathered latent rows (ouro/parallel/cp_context.py write_rows)"}


def boundary_note(ctx, first: int, op: str | None = None) -> str | None:
    """Name the configuration seam the first offending position sits on, if it does."""
    from ...parallel.cp_context import slice_bounds
    n = ctx["n"]
    for cfg in (ctx["a"], ctx["b"]):
        if cfg.cp > 1 and first in slice_bounds(n, cfg.cp)[1:-1]:
            rank = slice_bounds(n, cfg.cp).index(first)
            crossing = CP_EXCHANGE.get(op, "what the ranks exchange (conv halo, KDA state chain, DSA rows)")
            return f"first offending position {first} is where CP rank {rank} of {cfg.cp}'s slice starts: {crossing}"
        if cfg.prefix == "hit" and first == hit_tokens(cfg, n):
            return f"first offending position {first} is the first token after the prefix-cache hit: state restored at the hit"
        starts, s = [], 0
        for size in pieces(cfg, n):
            s += size
            starts.append(s)
        if cfg.chunk and first in starts[:-1] and first % cfg.chunk == 0:
            return f"first offending position {first} starts a prefill chunk (chunk={cfg.chunk}): state carried between chunks"
        if cfg.mode == "decode" and first == n - sum(1 for p in pieces(cfg, n) if p == 1):
            return f"first offending position {first} is the first decode step: prefill->decode state hand-over"
    return None


def divergence_finding(ra, rb, rows, i, col, ctx, label) -> Finding:
    r = rows[i]
    key, err, pos = r["key"], r["err"], r["positions"]
    bad = [p for p, o in zip(pos, r["offending"].tolist()) if o]
    module = key.rsplit(".", 1)[0] if r["op"] else key
    ours = rb if rb.ops else ra          # b is the run under test (a the reference); transformers records modules only
    op_key = key if r["op"] else _suspect_op(ours, key)
    op = op_key.rsplit(".", 1)[1] if op_key else r["kind"]
    src = _ouro_source(ours, op_key or key) or _ouro_source(ours, module)
    real = ours.op_at.get(op_key, {}).get(bad[0]) if op_key else None
    if real:    # one role, several ops (the chunked kernel and the recurrent step): the one that ran there
        op, src = real, ours.op_sources.get(real, src)
    fused = ours.fused_at.get(key, {}).get(bad[0])
    if fused:   # the row came out of a fused native op (`fused_taps`): that op is where to look
        op, src = fused, ours.op_sources.get(fused, src)
    worst = r["worst"]
    bound = ERROR_FACTOR * r["tol"] if r["tol"] > 0 else 0.05
    severity = "error" if not math.isfinite(worst) or worst > bound else "warning"
    top = sorted(zip(pos, err.tolist()), key=lambda t: -t[1])[:5]
    evidence = {
        "compared": label, "precision": col, "kind": r["kind"],
        "offending_positions": f"{len(bad)} of {len(pos)}", "first_offending_position": bad[0],
        "top_positions": [[p, _num(e)] for p, e in top],
        "growth": growth(pos, err),
        "error_by_quarter": [_num(float(q.mean())) for q in err.clamp(max=1e30).chunk(4)],
        "next_modules": [{"key": x["key"], "worst": _num(x["worst"]), "tol": x["tol"]} for x in rows[i + 1:i + 4]],
    }
    if src and op_key and ours.sources.get(module):
        evidence["module_source"] = "{}:{} {}()".format(*(lambda s: (s[0], s[2], s[1]))(ours.sources[module]))
    note = boundary_note(ctx, bad[0], op)
    if note:
        evidence["boundary"] = note
    tp_note = ""
    if ctx.get("tp_rank") is not None:
        disagree = ctx["tp_disagree"]
        evidence["tensor_parallel"] = {"rank": ctx["tp_rank"], "layout": _tp_layout(key),
                                       "reduced_outputs_the_ranks_disagree_on": disagree[:6]}
        if key in disagree:
            tp_note = (f"; rank {ctx['tp_rank']}'s output, and the ranks' outputs differ where every rank "
                       "should hold the reduced one (a partial sum left out of the all-reduce?)")
    layer = _layer(key)
    where = dict(module=module, layer=layer, op=op, positions=[bad[0], bad[-1]])
    if src:
        where.update(file=src[0], function=src[1], line=src[2])
    return Finding(PROBE, severity,
                   f"{label}: first divergence at {key} ({r['kind']}), rel RMS up to {_num(worst)} "
                   f"> {r['tol']:g} at positions {bad[0]}..{bad[-1]}{tp_note}",
                   where=where, measured=_num(worst), expected=r["tol"], evidence=evidence,
                   next=_next(ctx, layer, op, bad))


def _tp_layout(key: str) -> str:
    from .tp_run import layout
    return layout(key)


def _next(ctx, layer, op, bad) -> str:
    a, b = ctx["a"], ctx["b"]
    shorter = max(2 * PAGE_SIZE + 1 if "hit" in (a.prefix, b.prefix) else 8, min(ctx["prompt_len"], bad[0] + 8))
    base = f"ouro probe numerics --model {ctx['model']} --a '{a}' --b '{b}' --prompt-len {shorter}"
    if op in ("kda_chunk", "kda_recurrent_step", "causal_conv1d", "route", "experts_grouped", "sparse_mla", "sparse_mla_chunk",
              "index_select"):
        return f"ouro probe kernels --op {op}   (then: {base})"
    return base


def logits_finding(rows, label, clean, ctx) -> Finding:
    lg = next((r for r in rows if r["key"] == "lm_head"), None)
    margin = max(rows, key=lambda r: r["worst"] / r["tol"] if r["tol"] > 0 else (math.inf if r["worst"] > 0 else 0),
                 default=None)
    evidence = {"modules_compared": len(rows)}
    if margin is not None:
        evidence["closest_to_tolerance"] = {"key": margin["key"], "worst": _num(margin["worst"]), "tol": margin["tol"]}
    if lg is None:
        return Finding(PROBE, "info", f"{label}: logits were not compared (no common positions)", evidence=evidence)
    e = lg["err"]
    evidence.update(positions=len(lg["positions"]), mean=_num(float(e.clamp(max=1e30).mean())),
                    worst_position=lg["positions"][int(e.argmax())])
    status = "no module exceeds its tolerance" if clean else "see the divergence above"
    return Finding(PROBE, "info", f"{label}: logits agree to rel RMS {_num(lg['worst'])} (worst position); {status}",
                   where={"module": "lm_head"}, measured=_num(lg["worst"]), expected=lg["tol"], evidence=evidence)


def _num(x: float):
    return x if not math.isfinite(x) else float(f"{x:.3g}")
