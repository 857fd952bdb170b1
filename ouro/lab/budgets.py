"""`ouro probe budgets [FILE.toml]`: declared constraints over named measurements.

    [[budget]]
    name = "decode step near the roofline"
    scenario = "decode"                 # a scenario of ouro/lab/scenarios.py
    model = "tiny"                      # optional (default: --model, else tiny)
    check = "decode_step_ms <= 40.0 * roofline_ms"
    severity = "warning"                # optional: warning (default) or error

`check` is parsed with `ast` and may hold only measurement names, numbers, + - * / (and unary
minus) and comparisons. Each scenario runs once per model with the span tracer on; a failing
budget is a finding carrying the measurements and the scenario's worst intervals. A scenario that
repeats its measurement gives each measurement's 95% interval (`intervals`); a check over such
measurements is `met` only where it holds over the whole interval, `failed` where it holds nowhere
in it, and otherwise `inconclusive` (a finding too: a budget that passes by chance gates nothing).
The verdict and the scenario's A/B verdicts are in the finding's evidence.

With `--url URL` the serve scenario's measurements (ttft_p50_ms, tpot_ms) come from that running
server (traced on demand by /start_trace and /stop_trace) instead of a server started here; the
other scenarios still run in this process on --model (else each budget's model, else tiny), so
give the model the server serves when a check mixes the two.

Python API: `check_budgets(path=None, model=None, url=None, api_key=None) -> list[Finding]`."""

from __future__ import annotations

import ast
import operator
import os
import time
import tomllib

from .findings import Finding

PROBE = "budgets"
DEFAULT_FILE = os.path.join("budgets", "default.toml")
_BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_CMP = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
        ast.Eq: operator.eq, ast.NotEq: operator.ne}


def add_arguments(p) -> None:
    p.add_argument("file", nargs="?", default=None, help=f"budgets TOML (default: {DEFAULT_FILE})")
    p.add_argument("--model", default=None, help="run every budget on this preset or checkpoint directory")
    p.add_argument("--url", default=None, metavar="URL",
                   help="measure the serve scenario on this running `ouro serve`; other scenarios run here")
    p.add_argument("--api-key", default=None, help="the running server's API key (with --url)")


def run(args) -> list[Finding]:
    return check_budgets(args.file, args.model, getattr(args, "url", None), getattr(args, "api_key", None))


def default_path() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    # the checkout holding this package, then package data, then the working directory (a copy
    # of the package elsewhere, as the fault suite makes, still finds the repo's file)
    for root in (os.path.dirname(os.path.dirname(here)), here, os.getcwd()):
        p = os.path.join(root, DEFAULT_FILE)
        if os.path.exists(p):
            return p
    raise ValueError(f"no {DEFAULT_FILE} found next to the ouro package; pass a budgets file")


# ---- the budgets file ----
BUDGET_KEYS = ("name", "scenario", "check", "severity", "model")


def load_budgets(path: str) -> list[dict]:
    from .scenarios import MEASURES, SCENARIOS
    try:
        with open(path, "rb") as fh:
            doc = tomllib.load(fh)
    except FileNotFoundError:
        raise ValueError(f"budgets file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"budgets file {path} is not valid TOML: {e}") from None
    budgets = doc.get("budget")
    if not isinstance(budgets, list) or not budgets:
        raise ValueError(f"budgets file {path} has no [[budget]] tables")
    stray = sorted(set(doc) - {"budget"})
    if stray:
        raise ValueError(f"budgets file {path}: {stray} outside the [[budget]] tables")
    for i, b in enumerate(budgets):
        label = f"{path}: budget #{i + 1} ({b.get('name', 'unnamed')!r})"
        # a misspelt key (`severty = "error"`) would otherwise leave its default in force without a word
        unknown = sorted(set(b) - set(BUDGET_KEYS))
        if unknown:
            raise ValueError(f"{label}: unknown key(s) {unknown}; a budget takes {', '.join(BUDGET_KEYS)}")
        if not isinstance(b.get("model", ""), str):
            raise ValueError(f"{label}: model must be a model name (a string), got {b['model']!r}")
        missing = [k for k in ("name", "scenario", "check") if not isinstance(b.get(k), str)]
        if missing:
            raise ValueError(f"{label}: missing or non-string key(s) {missing}")
        if b["scenario"] not in SCENARIOS:
            raise ValueError(f"{label}: unknown scenario {b['scenario']!r}; known: {sorted(SCENARIOS)}")
        if b.get("severity", "warning") not in ("warning", "error"):
            raise ValueError(f"{label}: severity must be 'warning' or 'error', got {b['severity']!r}")
        try:
            unknown = [n for n in names_in(b["check"]) if n not in MEASURES]
        except ValueError as e:
            raise ValueError(f"{label}: {e}") from None
        if unknown:
            raise ValueError(f"{label}: unknown measurement(s) {unknown}; known: {sorted(MEASURES)}")
    return budgets


# ---- the safe check ----
def parse_check(text: str) -> ast.Expression:
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise ValueError(f"check {text!r} does not parse: {e.msg}") from None
    for node in ast.walk(tree):
        ok = isinstance(node, (ast.Expression, ast.Compare, ast.BinOp, ast.UnaryOp, ast.Name, ast.Load)) \
            or type(node) in _BIN or type(node) in _CMP or isinstance(node, (ast.USub, ast.UAdd)) \
            or (isinstance(node, ast.Constant) and type(node.value) in (int, float))
        if not ok:
            raise ValueError(f"check {text!r}: {type(node).__name__} is not allowed (only measurement names, "
                             "numbers, + - * / and comparisons)")
    return tree


def names_in(text: str) -> list[str]:
    return sorted({n.id for n in ast.walk(parse_check(text)) if isinstance(n, ast.Name)})


def evaluate(text: str, values: dict):
    """The check's value (True/False for a comparison) over `values`."""
    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in values:
                raise ValueError(f"check {text!r}: no measurement {node.id!r}; the scenario gives {sorted(values)}")
            return values[node.id]
        if isinstance(node, ast.UnaryOp):
            return -ev(node.operand) if isinstance(node.op, ast.USub) else ev(node.operand)
        if isinstance(node, ast.BinOp):
            return _BIN[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.Compare):
            left = ev(node.left)
            for op, right_node in zip(node.ops, node.comparators):
                right = ev(right_node)
                if not _CMP[type(op)](left, right):
                    return False
                left = right
            return True
        raise ValueError(f"check {text!r}: {type(node).__name__} is not allowed")
    try:
        return ev(parse_check(text))
    except ZeroDivisionError:
        raise ValueError(f"check {text!r}: division by zero with {values}") from None


def sides(text: str, values: dict) -> dict:
    """Each side of a single comparison, evaluated: what a finding shows as measured vs bound."""
    tree = parse_check(text).body
    if isinstance(tree, ast.Compare) and len(tree.ops) == 1:
        return {"left": evaluate(ast.unparse(tree.left), values),
                "right": evaluate(ast.unparse(tree.comparators[0]), values)}
    return {}


# ---- running ----
def measure(scenario: str, model_dir: str | None, url: str | None = None, api_key: str | None = None) -> dict:
    """Run one scenario with the tracer on; returns measurements, trace doc and seconds. With
    `url`, the serve scenario runs against that server."""
    import torch
    from . import scenarios
    from ..measure import spans
    t = time.perf_counter()
    if scenario == "serve" and url:
        r = scenarios.serve_url(url, heartbeat=False, api_key=api_key)
        r["seconds"] = time.perf_counter() - t
        return r
    threads = torch.get_num_threads()
    torch.set_num_threads(1)     # one thread, as the server's engine runs here: steadier on a shared machine
    try:
        r = _measure(scenarios, spans, scenario, model_dir)
    finally:
        torch.set_num_threads(threads)
    r["seconds"] = time.perf_counter() - t
    return r


def _measure(scenarios, spans, scenario: str, model_dir: str) -> dict:
    if scenario in ("serve", "offline", "pd"):     # they trace themselves
        kw = {"heartbeat": False} if scenario == "serve" else {}
        r = scenarios.SCENARIOS[scenario](model_dir, **kw)
    else:
        spans.clear()
        spans.enable()
        try:
            r = scenarios.SCENARIOS[scenario](model_dir)
        finally:
            spans.disable()
        r["trace"] = {"traceEvents": spans.chrome_events(process_name=f"ouro {scenario}")}
    return r


def check_budgets(path: str | None = None, model: str | None = None, url: str | None = None,
                  api_key: str | None = None) -> list[Finding]:
    from ..models.resolve import resolve_model
    from .scenarios import MEASURES
    path = path or default_path()
    budgets = load_budgets(path)
    results: dict = {}
    failed, passed = [], []

    def key(sc: str, name: str):
        return (sc, url) if sc == "serve" and url else (sc, name)   # the server is one, whatever the model
    for b in budgets:
        name = model or b.get("model", "tiny")
        needed = [b["scenario"]] + [MEASURES[n] for n in names_in(b["check"]) if n in MEASURES]
        values = {}
        for sc in dict.fromkeys(reversed(needed)):       # the budget's own scenario last: its values win
            if key(sc, name) not in results:
                local = None if sc == "serve" and url else str(resolve_model(name))
                results[key(sc, name)] = measure(sc, local, url, api_key)
            values.update(results[key(sc, name)]["measurements"])
        r = results[key(b["scenario"], name)]
        used = {n: round(values[n], 4) if isinstance(values.get(n), float) else values.get(n)
                for n in names_in(b["check"])}
        intervals = {n: r2 for sc in needed for n, r2 in results[key(sc, name)].get("intervals", {}).items()
                     if n in used}
        verdict = interval_verdict(b["check"], values, intervals)
        both = sides(b["check"], values)
        measured = {**used, **({"left": round(both["left"], 4), "right": round(both["right"], 4)} if both else {})}
        if intervals:
            measured["intervals"] = {n: [round(lo, 4), round(hi, 4)] for n, (lo, hi) in intervals.items()}
        extra = {"verdict": verdict, **({"ab": r["verdicts"]} if r.get("verdicts") else {}),
                 **({"thread_cpu_ms": r["thread_cpu_ms"]} if r.get("thread_cpu_ms") else {})}
        if verdict == "met":
            passed.append(Finding(PROBE, "info", f"budget passed: {b['name']} ({b['check']})",
                                  measured=measured, expected=b["check"],
                                  evidence={"scenario": b["scenario"], "model": name, **extra,
                                            **({"url": url} if url and b["scenario"] == "serve" else {})}))
            continue
        failed.append(_failure(b, name, r, measured, path, url if b["scenario"] == "serve" else None, extra))
    return failed + passed


def interval_verdict(text: str, values: dict, intervals: dict) -> str:
    """`met` when the check holds at every corner of its measurements' intervals (a measurement
    without one counts at its value), `failed` when it holds at none, else `inconclusive`: the
    noise spans the bound, and a budget that would pass or fail by chance gates nothing."""
    import itertools
    names = sorted(intervals)
    corners = [dict(values, **dict(zip(names, c))) for c in itertools.product(*(intervals[n] for n in names))]
    held = [bool(evaluate(text, c)) for c in corners] or [bool(evaluate(text, values))]
    return "met" if all(held) else "failed" if not any(held) else "inconclusive"


def _failure(b: dict, model: str, r: dict, measured: dict, path: str, url: str | None = None,
             extra: dict | None = None) -> Finding:
    from .timeline.probe import analyse_doc
    findings = analyse_doc(r["trace"]) if r.get("trace") else []
    top = [{"severity": f.severity, "summary": f.summary, "where": f.where} for f in findings[:3]]
    longest = _longest_spans(r.get("trace"))
    where = next((f.where for f in findings if f.severity != "info" and f.where), None)
    if where is None and longest:
        where = {"thread": longest[0]["thread"], "interval": longest[0]["interval"]}
    extra = extra or {"verdict": "failed"}
    state = "failed" if extra["verdict"] == "failed" else "inconclusive (the interval spans the bound)"
    return Finding(PROBE, b.get("severity", "warning"), f"budget {state}: {b['name']} ({b['check']})",
                   where=where or {}, measured=measured, expected=b["check"],
                   evidence={"scenario": b["scenario"], "model": model, **extra, "measurements": r["measurements"],
                             "worst_intervals": longest, "timeline": top, "trace_path": r.get("trace_path"),
                             "seconds": round(r["seconds"], 1), **({"url": url} if url else {})},
                   next=(f"ouro probe timeline --url {url} --trace-out t.json" if url else
                         f"ouro probe timeline --model {model} --scenario "
                         f"{b['scenario'] if b['scenario'] in ('serve', 'pd') else 'offline'} --trace-out t.json")
                   + f"; budgets: {path}")


def _longest_spans(doc, n: int = 3) -> list[dict]:
    """The scenario's longest spans (not windows), each with its interval from the trace start."""
    if not doc:
        return []
    from ..measure.chrome_trace import spans_of
    spans = [s for s in spans_of(doc) if s["cat"] not in ("pending", "request")]
    if not spans:
        return []
    t0 = min(s["start_ms"] for s in spans)
    top = sorted(spans, key=lambda s: -s["dur_ms"])[:n]
    return [{"span": s["name"], "cat": s["cat"], "thread": s["thread"], "dur_ms": round(s["dur_ms"], 3),
             "interval": [round(s["start_ms"] - t0, 3), round(s["end_ms"] - t0, 3)]} for s in top]
