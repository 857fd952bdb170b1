"""`ouro probe timeline`: run a short traced scenario (offline generate in this process, or a
real `ouro serve --trace` with a few HTTP requests) with the heartbeat on, or trace a server
that is already running (`--url`: /start_trace, the same streamed requests, /stop_trace), or
read an existing trace, and report GIL starvation, idle gaps of the engine loop, time per
category and the overlap between categories, worst intervals first.

Python API: `timeline(model, scenario="offline", requests=4, trace_out=None, from_trace=None,
max_tokens=8, url=None, api_key=None)` -> list[Finding]."""

from __future__ import annotations

import json

from ...measure.chrome_trace import heartbeats_of, load, spans_of
from ..findings import Finding
from .analysis import analyse


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny", help="preset name or checkpoint directory (default: tiny)")
    p.add_argument("--scenario", default="offline", choices=["offline", "serve", "pd"],
                   help="pd: a prefill here handing its state to a real decode worker (--prompt-len tokens)")
    p.add_argument("--prompt-len", type=int, default=256, help="pd: the prompt's length")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--trace-out", default=None, metavar="FILE", help="write the run's Chrome trace here")
    p.add_argument("--from-trace", default=None, metavar="FILE", help="analyse this trace instead of running")
    p.add_argument("--url", default=None, metavar="URL",
                   help="trace this running `ouro serve` (e.g. http://127.0.0.1:8000) instead of starting one; "
                        "--model and --scenario are then unused")
    p.add_argument("--api-key", default=None, help="the running server's API key (with --url)")


def run(args) -> list[Finding]:
    return timeline(args.model, args.scenario, args.requests, args.trace_out, args.from_trace,
                    max_tokens=getattr(args, "max_tokens", 8), url=getattr(args, "url", None),
                    api_key=getattr(args, "api_key", None), prompt_len=getattr(args, "prompt_len", 256))


def timeline(model="tiny", scenario: str = "offline", requests: int = 4, trace_out: str | None = None,
             from_trace: str | None = None, max_tokens: int = 8, url: str | None = None,
             api_key: str | None = None, prompt_len: int = 256) -> list[Finding]:
    if from_trace:
        doc, path = load(from_trace), from_trace
    elif url:
        from ..serve_scenarios import serve_url
        r = serve_url(url, requests, max_tokens, trace_out=trace_out, api_key=api_key)
        doc, path = r["trace"], r["trace_path"]
    else:
        doc, path = trace_of(model, scenario, requests, trace_out, max_tokens, prompt_len)
    findings = analyse_doc(doc)
    for f in findings:                      # every finding points at the trace to open
        if path and isinstance(f.evidence, dict):
            f.evidence.setdefault("trace", path)
    return findings


def trace_of(model, scenario: str, requests: int, trace_out: str | None, max_tokens: int = 8, prompt_len: int = 256):
    """Run the scenario traced; returns (Chrome trace doc, path where it was written or None)."""
    from ...models.resolve import resolve_model
    from .. import scenarios
    directory = str(resolve_model(model))
    if scenario == "serve":
        r = scenarios.serve(directory, requests, max_tokens, trace_out=trace_out)
        return r["trace"], r["trace_path"]
    if scenario == "pd":
        r = scenarios.pd(directory, prompt_len, rounds=1)     # one traced round is what the timeline reads
    else:
        r = scenarios.offline(directory, requests, max_tokens)
    if trace_out:
        with open(trace_out, "w") as fh:
            json.dump(r["trace"], fh)
    return r["trace"], trace_out


def analyse_doc(doc: dict) -> list[Finding]:
    return analyse(spans_of(doc), heartbeats_of(doc))


def worst_intervals(doc: dict, n: int = 3) -> list[dict]:
    """The top findings of a trace in brief (what a failing budget carries as evidence)."""
    out = []
    for f in analyse_doc(doc)[:n]:
        out.append({"severity": f.severity, "summary": f.summary, "where": f.where})
    return out
