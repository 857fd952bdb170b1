"""`ouro probe kernels`: per-op microbenchmarks, correct first. For every op, shape (a prefill of a
few hundred tokens and a decode step of a small batch, from the model config) and launch
parameter: the fast op against its naive reference on fresh random inputs (a wrong op is an
`error` and gets no time), then the median over interleaved repeats (a sweep's variants take turns,
fresh inputs each round), the FLOPs and bytes a call must cost, the share of the machine's roofline
that reaches, and the op's share of a real model step, so each finding says how far a faster kernel
can move the step (Amdahl)."""

from __future__ import annotations

import statistics
import time

import torch

from ...measure.roofline import Roofline
from ...native.kernels import eager_only
from ..findings import Finding
from .cases import CASES, DEFAULT_OPS, KernelCase
from .refs import Phase
from .report import PROBE, format_report, op_tests, params_text, speed_finding, sweep_finding, where_of
from .steps import amdahl, step_shares

ROUND_BUDGET_S = 0.5     # auto repeats: about this much timing per (op, phase)


def add_arguments(p) -> None:
    p.add_argument("--model", default="small", help="preset name or checkpoint directory (shapes and the step)")
    p.add_argument("--op", nargs="+", action="extend", default=None, choices=list(CASES), metavar="OP",
                   help=f"ops to probe (default: all: {', '.join(DEFAULT_OPS)})")
    p.add_argument("--sweep", action="append", default=None, metavar="PARAM=V1,V2",
                   help="launch parameter values to compare with the default, e.g. chunk=16,32,64")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds per op (default: auto, 5..30)")
    p.add_argument("--prefill-len", type=int, default=None, help="prefill tokens (default: 256, or more so sparse selection is used)")
    p.add_argument("--decode-batch", type=int, default=4)
    p.add_argument("--no-step", action="store_true", help="skip the model step (no end-to-end shares)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads while measuring (default 1: on a shared machine, multi-threaded ops stall "
                        "whenever a sibling thread is descheduled, and timings stop meaning anything)")
    p.add_argument("--seed", type=int, default=0)


def parse_sweeps(items) -> dict[str, list]:
    out = {}
    for item in items or []:
        name, _, values = item.partition("=")
        if not name or not values:
            raise ValueError(f"--sweep takes PARAM=V1,V2,..., got {item!r}")
        out[name.strip()] = [_number(v) for v in values.split(",") if v.strip()]
    return out


def _number(v: str):
    v = v.strip()
    try:
        return int(v)
    except ValueError:
        return float(v)


def run(args) -> list[Finding]:
    report: list[dict] = []
    findings = probe_kernels(args.model, ops=args.op, sweeps=parse_sweeps(args.sweep), repeats=args.repeats,
                             prefill_len=args.prefill_len, decode_batch=args.decode_batch, step=not args.no_step,
                             seed=args.seed, threads=args.threads, report=report)
    print(format_report(report))
    print()
    return findings


def _variants(case: KernelCase, sweeps: dict) -> list[dict]:
    """The default launch parameters first, then each swept value of a parameter the op takes."""
    out = [dict(case.params)]
    for name, values in sweeps.items():
        if name in case.params:
            out += [{**case.params, name: v} for v in values if v != case.params[name]]
    return out


def _check(case, fn, cfg, ph, params, seed) -> tuple[float, dict, str]:
    """(worst error, error per output, what it raised) on fresh seeded inputs."""
    x = case.make(cfg, ph, torch.Generator().manual_seed(seed))
    try:
        with torch.no_grad():
            err = case.check(case.run(fn, x, **params), x, cfg, ph)
    except Exception as e:  # a crashing kernel is a wrong kernel
        return float("inf"), {}, f"{type(e).__name__}: {e}"[:300]
    parts = err if isinstance(err, dict) else {}
    worst = max(parts.values(), key=lambda e: e if e == e else float("inf")) if parts else err
    return (float("inf") if worst != worst else worst), parts, ""


def _time(case, fn, cfg, ph, variants, repeats, seed) -> list[list[float]]:
    """Interleaved rounds: each round a fresh input, every variant once, the order rotating."""
    gen = torch.Generator().manual_seed(seed + 1)
    x = case.make(cfg, ph, gen)
    times = [[] for _ in variants]
    with torch.no_grad():
        t0 = time.perf_counter()
        for p in variants:                                    # warm-up round, not counted
            case.run(fn, x, **p)
        warm = time.perf_counter() - t0
        least = 5 if len(variants) == 1 else 7    # a sweep's verdict needs a few more pairs
        n = repeats or max(least, min(30, int(ROUND_BUDGET_S / max(warm, 1e-6))))
        for r in range(n):
            x = case.fresh(x, gen) if case.fresh else case.make(cfg, ph, gen)
            for i in [(r + j) % len(variants) for j in range(len(variants))]:
                t0 = time.perf_counter()
                case.run(fn, x, **variants[i])
                times[i].append(time.perf_counter() - t0)
    return times


def phases_for(cfg, prefill_len: int | None, decode_batch: int) -> dict[str, Phase]:
    # a few hundred tokens, and past the point where the indexer's selection starts to drop pools
    L = prefill_len or max(256, cfg.index_topk + 128)
    return {"prefill": Phase("prefill", L, 1, L), "decode": Phase("decode", decode_batch, decode_batch, L)}


def probe_kernels(model="small", ops=None, sweeps=None, repeats=None, prefill_len=None, decode_batch=4,
                  step=True, seed=0, threads: int | None = 1, report: list | None = None) -> list[Finding]:
    """The kernels probe as a function. `model`: preset name or checkpoint directory; `ops`: names
    from `kernel_cases.CASES` (default all); `sweeps`: {param: [values]}; `step`: also time the ops
    inside one real prefill and one decode step of the model. `report`, if given, receives one
    dict per (op, phase, params) measured; `threads`: torch threads while measuring (None: as set).
    Returns findings, most important first."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        # the cases are the eager kernels (`cases.py`): the steps they are timed inside run eagerly
        # too; the fused native ops are each one call, timed by `benchmarks/decode_breakdown.py`
        with eager_only():
            return _probe(model, ops, sweeps, repeats, prefill_len, decode_batch, step, seed, report)
    finally:
        torch.set_num_threads(before)


def _probe(model, ops, sweeps, repeats, prefill_len, decode_batch, step, seed, report) -> list[Finding]:
    from ...config import ModelConfig
    from ...models.resolve import resolve_model
    directory = resolve_model(str(model), progress=False)
    cfg = ModelConfig.from_hf(directory)
    cases = [CASES[o] for o in (ops or DEFAULT_OPS)]
    phases = phases_for(cfg, prefill_len, decode_batch)
    roof = Roofline.measure()
    errors, sweep_notes, rows = [], [], []
    for case in cases:
        for pname in case.phases:
            e, r, note = _measure(case, cfg, phases[pname], _variants(case, sweeps or {}), roof, repeats, seed)
            errors, rows, sweep_notes = errors + e, rows + r, sweep_notes + note
    shares = None
    if step and any(r["correct"] for r in rows):
        try:
            shares = step_shares(_load(directory), {c.name: c.calls for c in cases}, phases["prefill"].rows,
                                 decode_batch, seed=seed)
        except Exception as e:   # the ops' own verdicts stand; only the step shares are missing
            errors.append(Finding(PROBE, "warning", f"the model step failed, so no op has a step share: "
                                  f"{type(e).__name__}: {e}"[:300], where={"function": "forward"},
                                  next=f"ouro generate {model} --max-tokens 4"))
    speed = []
    for r in rows:
        if r["correct"] and r["params"] == dict(CASES[r["op"]].params):
            _add_share(r, shares)
            speed.append(speed_finding(CASES[r["op"]], r))
    if report is not None:
        report.extend(rows)
    warn = sorted((f for f in speed if f.severity == "warning"), key=lambda f: -f.measured["step_gain_at_floor"])
    info = sorted((f for f in speed if f.severity == "info"), key=lambda f: -(f.measured.get("step_share") or 0))
    return errors + warn + sweep_notes + info


def _measure(case, cfg, ph, variants, roof, repeats, seed):
    """One op at one phase: every variant checked, the correct ones timed together.
    Returns (error findings, report rows, sweep findings)."""
    fn, errors, rows, ok = case.fast(), [], [], []
    for params in variants:
        err, parts, crash = _check(case, fn, cfg, ph, params, seed)
        if err <= case.tol:              # NaN and inf fail this
            ok.append(params)
            continue
        label = f"{case.name} ({ph.name}{', ' + params_text(params)[1:-1] if params else ''})"
        wrong = [k for k, e in parts.items() if not e <= case.tol]
        errors.append(Finding(
            PROBE, "error", f"{label} disagrees with its naive reference: "
            + (crash or f"error {err:.3g} > tolerance {case.tol:g}" + (f" in {', '.join(wrong)}" if wrong else ""))
            + "; no speed reported", where=where_of(case, fn, params, ph.name),
            measured={"error": err, "per_output": parts or None, "raised": crash or None},
            expected={"tolerance": case.tol}, evidence={"shape": vars(ph), "params": params},
            next=f"python -m pytest -q {op_tests(case)}; ouro probe kernels --op {case.name}"))
        rows.append({"op": case.name, "phase": ph.name, "params": params, "correct": False, "error": err})
    if not ok:
        return errors, rows, []
    times = _time(case, fn, cfg, ph, ok, repeats, seed)
    flops, nbytes = case.cost(cfg, ph)
    floor = roof.floor_s(flops, nbytes)
    for params, ts in zip(ok, times):
        med = statistics.median(ts)
        rows.append({"op": case.name, "phase": ph.name, "params": params, "correct": True, "median_s": med,
                     "repeats": len(ts), "flops": flops, "bytes": nbytes, "floor_s": floor,
                     "roofline_share": floor / med if med > 0 else 0.0, "times": ts})
    return errors, rows, [sweep_finding(case, fn, ph.name, ok, times)] if len(ok) > 1 else []


def _load(directory):
    from ...models.loader import load_model
    return load_model(directory)


def _add_share(r: dict, shares: dict | None) -> None:
    if shares is None:
        return
    s = shares[r["phase"]]
    op = s["ops"].get(r["op"])
    share = op["share"] if op else 0.0
    r.update({"step_s": s["step_s"], "in_step_s": op["s"] if op else 0.0, "calls_per_step": op["calls"] if op else 0,
              "step_share": share, "bound_k2": amdahl(share, 2), "bound_inf": amdahl(share, float("inf")),
              "step_gain_at_floor": amdahl(share, max(1.0, 1 / r["roofline_share"]) if r["roofline_share"] else float("inf"))})
