"""What the kernels probe says: a finding per op (time, roofline share, step share and the Amdahl
bounds), a finding per sweep (the best launch parameters, with the A/B verdict against the
default) and the table it prints."""

from __future__ import annotations

import inspect
import os
import statistics

from ...measure.ab import verdict_from_times
from ..findings import Finding
from .cases import KernelCase

PROBE = "kernels"
WARN_ROOF_SHARE = 0.10   # an op reaching less than this share of its floor speed ...
WARN_STEP_GAIN = 1.5     # ... whose reaching the floor would make its step >= 1.5x faster: warning


def where_of(case: KernelCase, fn, params: dict, phase: str) -> dict:
    w = {"file": case.file, "function": case.function, "op": f"{case.name}[{phase}]" + params_text(params)}
    try:   # the line only when the function the model calls really lives in the case's file
        src = os.path.normpath(inspect.getsourcefile(fn) or "")
        if src.endswith(os.path.normpath(case.file)):
            w["line"] = fn.__code__.co_firstlineno
    except (TypeError, AttributeError):
        pass
    return w


def op_tests(case: KernelCase) -> str:
    """The op family's test file: ouro/ops/kda/chunk.py -> tests/ops/test_kda.py."""
    parts = case.file.split("/")
    return f"tests/ops/test_{parts[2].removesuffix('.py')}.py"


def params_text(params: dict) -> str:
    return "(" + ",".join(f"{k}={v}" for k, v in params.items()) + ")" if params else ""


def speed_finding(case: KernelCase, r: dict) -> Finding:
    ms = r["median_s"] * 1e3
    head = (f"{case.name} ({r['phase']}): {ms:.3f} ms per call, {r['roofline_share']:.1%} of the roofline "
            f"(floor {r['floor_s'] * 1e3:.3f} ms)")
    measured = {k: r[k] for k in ("median_s", "floor_s", "roofline_share", "repeats") if k in r}
    sev = "info"
    if "step_share" in r:
        head += (f"; {r['step_share']:.1%} of a {r['phase']} step ({r['calls_per_step']} calls): a 2x faster kernel "
                 f"gives the step {r['bound_k2']:.3f}x, an infinitely fast one {r['bound_inf']:.3f}x")
        measured.update({k: r[k] for k in ("step_s", "in_step_s", "step_share", "bound_k2", "bound_inf",
                                           "step_gain_at_floor")})
        if r["roofline_share"] < WARN_ROOF_SHARE and r["step_gain_at_floor"] >= WARN_STEP_GAIN:
            sev = "warning"
            head = f"best Amdahl target: {head}"
    evidence = [["op", "phase", "ms", "floor ms", "roof", "step share", "x2", "inf"],
                [case.name, r["phase"], round(ms, 4), round(r["floor_s"] * 1e3, 4), round(r["roofline_share"], 4),
                 round(r.get("step_share", float("nan")), 4), round(r.get("bound_k2", float("nan")), 4),
                 round(r.get("bound_inf", float("nan")), 4)]]
    return Finding(PROBE, sev, head, where=where_of(case, case.fast(), r["params"], r["phase"]), measured=measured,
                   expected={"floor_s": r["floor_s"], "flops": r["flops"], "bytes": r["bytes"]}, evidence=evidence,
                   next=f"ouro probe kernels --op {case.name}" + "".join(
                       f" --sweep {k}={v},{2 * v}" for k, v in case.params.items() if isinstance(v, int)))


def sweep_finding(case, fn, phase, variants, times) -> Finding:
    meds = [statistics.median(t) for t in times]
    best = min(range(len(variants)), key=lambda i: meds[i])
    v = verdict_from_times(times[0], times[best], params_text(variants[0]), params_text(variants[best]))
    table = [["params", "median ms", "vs default"]] + [
        [params_text(p), round(m * 1e3, 4), round(m / meds[0], 3)] for p, m in zip(variants, meds)]
    if best == 0 or v.verdict != "faster":
        summary = (f"{case.name} ({phase}) sweep: the default {params_text(variants[0])} is best or no variant is "
                   f"faster beyond noise (best {params_text(variants[best])}: {v.verdict}, time ratio {v.ratio:.3f}, "
                   f"interval {v.low:.3f}..{v.high:.3f})")
    else:
        summary = (f"{case.name} ({phase}) sweep: {params_text(variants[best])} is faster than the default "
                   f"{params_text(variants[0])} ({v.ratio:.3f}x the time, interval {v.low:.3f}..{v.high:.3f})")
    return Finding(PROBE, "info", summary, where=where_of(case, fn, variants[best], phase),
                   measured={"best": variants[best], "verdict": v.to_dict()}, expected={"default": variants[0]},
                   evidence=table, next=f"ouro probe kernels --op {case.name} --sweep ... --repeats 30")


def format_report(rows: list[dict]) -> str:
    if not rows:
        return "kernels: nothing measured"
    head = f"{'op':<20} {'phase':<8} {'params':<14} {'ms':>9} {'floor ms':>9} {'roof':>6} {'step':>6} {'x2':>6} {'inf':>6}"
    lines = [head]
    for r in rows:
        p = params_text(r["params"])
        if not r["correct"]:
            lines.append(f"{r['op']:<20} {r['phase']:<8} {p:<14} {'WRONG (error ' + format(r['error'], '.3g') + ')':>9}")
            continue
        share = f"{r['step_share']:6.1%} {r['bound_k2']:6.3f} {r['bound_inf']:6.3f}" if "step_share" in r else ""
        lines.append(f"{r['op']:<20} {r['phase']:<8} {p:<14} {r['median_s'] * 1e3:9.3f} {r['floor_s'] * 1e3:9.3f} "
                     f"{r['roofline_share']:6.1%} {share}")
    return "\n".join(lines)
