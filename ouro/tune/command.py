"""`ouro tune --model M --output tuned.toml`: the command line of the tuner."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..config.flags import int_in, rate


def add_tune_parser(sub) -> None:
    t = sub.add_parser("tune", help="search this machine's fastest serving configuration, each step verified; "
                                    "write it for `ouro serve --config`")
    t.add_argument("--model", default="small", help="checkpoint directory or preset name (default: small)")
    t.add_argument("--workload", default="offline", choices=["offline", "serve"],
                   help="offline: the engine's throughput on a batch of random prompts; serve: each candidate "
                        "as a real `ouro serve --config` process under `ouro bench serve`'s streaming load")
    t.add_argument("--quality-budget", default="0.7%",
                   help="held-out bits/byte an output-changing option may cost against float32 (e.g. 0.7%%)")
    t.add_argument("--quality-model", default=None,
                   help="where bits/byte is measured (default: --model, or tiny-py for a random-init preset)")
    t.add_argument("--output", default="tuned.toml", help="the winning configuration, for ouro serve --config")
    t.add_argument("--journal", default=None, help="every candidate, one JSON line each; a rerun resumes from it "
                                                   "(default: OUTPUT with .journal.jsonl)")
    t.add_argument("--num-prompts", type=int_in(1), default=8)
    t.add_argument("--input-len", type=int_in(1), default=64)
    t.add_argument("--output-len", type=int_in(1), default=32)
    t.add_argument("--max-concurrency", type=int_in(1), default=8)
    t.add_argument("--request-rate", type=rate, default=float("inf"),
                   help="serve: requests per second (Poisson arrivals); inf sends them all at once")
    t.add_argument("--objective", default="throughput", choices=["throughput", "ttft"],
                   help="what a candidate must improve to be kept: the workload's time (throughput), or with "
                        "--workload serve the clients' median time to first token (ttft)")
    t.add_argument("--max-memory", type=int_in(1), default=512 << 20, help="cache bytes of every candidate")
    t.add_argument("--rounds", type=int_in(1), default=3, help="A/B rounds per candidate (each runs both sides)")
    t.add_argument("--no-ablation", action="store_true", help="skip removing each kept option from the winner")
    t.add_argument("--no-gap", action="store_true", help="skip the winner's decode step part by part against its floor")
    t.add_argument("--json", default=None, metavar="FILE", help="write the journal and the ablation as JSON")
    t.set_defaults(func=run_tune)


def _budget(text: str) -> float:
    t = text.strip()
    try:
        v = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        v = float("nan")
    if not 0 <= v < float("inf"):
        raise ValueError(f"--quality-budget takes a fraction or a percentage >= 0 (0.007 or 0.7%), got {text!r}")
    return v


def quality_model(model_dir: Path, given) -> Path:
    """The checkpoint bits/byte is measured on: a random-init preset has no text to score."""
    from ..models.resolve import resolve_model
    if given:
        return resolve_model(given, progress=True)
    marker = Path(model_dir) / "ouro_preset.json"
    if marker.is_file() and json.loads(marker.read_text()).get("random_init"):
        return resolve_model("tiny-py", progress=True)
    return Path(model_dir)


def run_tune(args) -> int:
    from ..config.file import write_config_file
    from ..models.resolve import resolve_model
    from .report import format_ablation, format_journal, motivations
    from .search import Tuner, Workload
    budget = _budget(args.quality_budget)
    for path in (args.output, args.journal):
        if path and not Path(path).resolve().parent.is_dir():
            raise ValueError(f"{path}: its directory {Path(path).resolve().parent} does not exist")
    model_dir = resolve_model(args.model, progress=True)
    if args.workload != "serve" and args.request_rate != float("inf"):
        raise ValueError("--request-rate is for --workload serve (the offline workload queues every prompt at once)")
    wl = Workload(args.num_prompts, args.input_len, args.output_len, args.max_concurrency, 0, args.max_memory,
                  args.workload, args.request_rate, args.objective)
    journal = args.journal or str(Path(args.output).with_suffix(".journal.jsonl"))
    tuner = Tuner(model_dir, wl, journal, budget, quality_model(model_dir, args.quality_model), args.rounds,
                  log=lambda s: print(s, file=sys.stderr))
    why = motivations(model_dir, wl)
    print(f"ouro tune: {model_dir.name}, {wl.kind} workload {wl.num_prompts} x {wl.input_len} in / {wl.output_len} out at "
          f"concurrency {wl.concurrency}, objective {wl.objective}; quality on {tuner.quality_dir.name} within +{budget:.2%}; journal {journal}",
          file=sys.stderr)
    for name, reason in tuner.space.left_out.items():
        print(f"  left out: {name}: {reason}", file=sys.stderr)
    try:
        best = tuner.search()
        from .space import BASELINE, choice_of
        summary = {o.name: choice_of(best, o) for o in tuner.space.options}
        write_config_file(args.output, best, comment=f"ouro tune on {model_dir.name}: " + ", ".join(
            f"{k}={v}" for k, v in summary.items()), extra={"model": str(args.model), "quality_budget": round(budget, 6),
                                                    "workload": wl.kind})
        print(f"wrote {args.output}: {best}")
        print(format_journal(tuner.journal.in_order("candidate")))
        ablation = gap = None
        if not args.no_ablation and best != BASELINE:
            ablation = tuner.ablation(best)
            print(format_ablation(ablation, why))
        if not args.no_gap:
            from ..measure.step_breakdown import format_breakdown
            gap = tuner.gap(best)
            print(format_breakdown(gap))
    finally:
        tuner.close()
    if args.json:
        Path(args.json).write_text(json.dumps({"best": best, "journal": tuner.journal.in_order("candidate"),
                                               "ablation": ablation, "gap": gap, "motivations": why}, indent=2))
    return 0
