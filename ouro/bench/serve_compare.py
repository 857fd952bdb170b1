"""`ouro bench serve --base-url A --compare-base-url B`: the same prompts against two servers on
this machine (say a single `ouro serve` and an `ouro serve --disagg 1P1D`), in alternating rounds
(A, B, A, B, ...: --repeats each), medians per side and B over A as ratios."""

from __future__ import annotations

import asyncio
import math
import statistics

from .load_gen import run_load, served_model, workload_prompts
from .serve import calculate_metrics, vocab_range

FIGURES = (("output_throughput", "Output token throughput (tok/s)"), ("request_throughput", "Request throughput (req/s)"),
           ("ttft", "Median TTFT (ms)"), ("tpot", "Median TPOT (ms)"), ("itl", "Median ITL (ms)"),
           ("e2el", "Median E2EL (ms)"))


def _figures(m: dict) -> dict:
    out = {"output_throughput": m["output_throughput"], "request_throughput": m["request_throughput"],
           "failed": m["failed"]}
    for k in ("ttft", "tpot", "itl", "e2el"):
        out[k] = m[f"{k}_ms"]["median"]
    return out


def compare_serve(args) -> dict:
    urls = {"A": args.base_url, "B": args.compare_base_url}
    models = {side: args.model or served_model(url, args.api_key).get("id") for side, url in urls.items()}
    rng, rng_from = vocab_range(args.vocab_range, None)
    prompts, endpoint = workload_prompts(args, rng)
    rounds = {"A": [], "B": []}
    for _ in range(max(1, args.repeats)):
        for side, url in urls.items():
            records, duration = asyncio.run(run_load(url, endpoint, models[side], prompts, args.output_len,
                                                     args.request_rate, args.max_concurrency, args.seed, args.api_key,
                                                     progress=not args.disable_tqdm))
            rounds[side].append(_figures(calculate_metrics([r.to_dict() for r in records], duration)))
    med = {side: {k: statistics.median(r[k] for r in rs if r[k] is not None) if any(r[k] is not None for r in rs)
                  else None for k in rs[0]} for side, rs in rounds.items()}
    ratio = {k: (med["B"][k] / med["A"][k] if med["A"][k] and med["B"][k] is not None else None) for k, _ in FIGURES}
    return {"A": urls["A"], "B": urls["B"], "num_prompts": args.num_prompts, "random_input_len": args.input_len,
            "random_output_len": args.output_len, "max_concurrency": args.max_concurrency,
            "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
            "repeats": max(1, args.repeats), "vocab_range": list(rng), "vocab_range_from": rng_from,
            "rounds": rounds, "median": med, "b_over_a": ratio}


def format_compare(r: dict) -> str:
    lines = ["{s:{c}^{n}}".format(s=" Serving A vs B (same prompts, alternating rounds) ", n=72, c="="),
             f"A: {r['A']}", f"B: {r['B']}",
             f"{r['num_prompts']} prompts x {r['random_input_len']} tokens in, {r['random_output_len']} out, "
             f"concurrency {r['max_concurrency']}, {r['repeats']} round(s) each, medians",
             "{:<36} {:>11} {:>11} {:>9}".format("", "A", "B", "B / A")]
    fmt = lambda v, f="{:.2f}": "n/a" if v is None else f.format(v)
    for key, label in FIGURES:
        lines.append("{:<36} {:>11} {:>11} {:>9}".format(label, fmt(r["median"]["A"][key]), fmt(r["median"]["B"][key]),
                                                           fmt(r["b_over_a"][key], "{:.3f}")))
    lines.append("{:<36} {:>11} {:>11}".format("Failed requests (median)", fmt(r["median"]["A"]["failed"], "{:.0f}"),
                                               fmt(r["median"]["B"]["failed"], "{:.0f}")))
    return "\n".join(lines + ["=" * 72])
