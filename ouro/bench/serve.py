"""`ouro bench serve`: the vLLM / SGLang `bench_serving` figures for an OpenAI-compatible server
(throughputs; TTFT, TPOT, ITL and end-to-end latency as mean / median / p99), and with
`--compare-offline MODEL` the same work through the offline engine in this process after the
online run, so the server's overhead shows as ratios measured side by side."""

from __future__ import annotations

import asyncio
import math
import os
import statistics
import time

from ..measure.spans import span
from .load_gen import FALLBACK_VOCAB_RANGE, run_load, served_model, workload_prompts

LATENCIES = (("ttft", "Time to First Token", "TTFT"), ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
             ("itl", "Inter-token Latency", "ITL"), ("e2el", "End-to-end Latency", "E2EL"))


def percentile(xs, q: float) -> float:
    """numpy's default ('linear'): the value at rank (n - 1) * q / 100, interpolated."""
    xs = sorted(xs)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary_ms(xs_s) -> dict:
    """mean / median / std / p99 / min / max in milliseconds of a list of seconds (None if empty)."""
    xs = [1e3 * x for x in xs_s]
    if not xs:
        return {k: None for k in ("mean", "median", "std", "p99", "min", "max", "count")}
    return {"mean": statistics.fmean(xs), "median": statistics.median(xs), "std": statistics.pstdev(xs),
            "p99": percentile(xs, 99), "min": min(xs), "max": max(xs), "count": len(xs)}


def calculate_metrics(records: list[dict], duration: float) -> dict:
    """The run's figures from per-request records (dicts with success, prompt_tokens,
    output_tokens, ttft, e2e, itl in seconds). TPOT per request is (e2e - ttft) /
    (output_tokens - 1), over requests with more than one output token."""
    ok = [r for r in records if r["success"]]
    n_in = sum(r["prompt_tokens"] for r in ok)
    n_out = sum(r["output_tokens"] for r in ok)
    tpot = [(r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1) for r in ok if r["output_tokens"] > 1]
    return {"completed": len(ok), "failed": len(records) - len(ok), "duration_s": duration,
            "total_input_tokens": n_in, "total_output_tokens": n_out,
            "request_throughput": len(ok) / duration, "input_throughput": n_in / duration,
            "output_throughput": n_out / duration, "total_token_throughput": (n_in + n_out) / duration,
            "ttft_ms": summary_ms([r["ttft"] for r in ok]), "tpot_ms": summary_ms(tpot),
            "itl_ms": summary_ms([g for r in ok for g in r["itl"]]), "e2el_ms": summary_ms([r["e2e"] for r in ok])}


def overhead_ratios(metrics: dict, offline: dict) -> dict:
    """Server over offline engine: output throughput, median ITL over the median decode step,
    median TTFT over the prefill of one prompt."""
    def div(a, b):
        return a / b if a is not None and b else None
    return {"output_throughput": div(metrics["output_throughput"], offline["output_throughput"]),
            "itl_over_decode_step": div(metrics["itl_ms"]["median"], offline["decode_step_ms"]),
            "ttft_over_prefill": div(metrics["ttft_ms"]["median"], offline["prefill_ms"])}


def vocab_range(spec: str | None, model_dir) -> tuple[tuple[int, int], str]:
    """(LO, HI) for the prompt ids and where it came from: --vocab-range LO,HI; else
    [min(1000, V // 2), V) with V = min(vocab, tokenizer size) of the --compare-offline model;
    else FALLBACK_VOCAB_RANGE."""
    if spec:
        try:
            lo, hi = (int(x) for x in spec.split(","))
        except ValueError:
            raise ValueError(f"--vocab-range takes LO,HI (two integers), got {spec!r}") from None
        return (lo, hi), "--vocab-range"
    if model_dir is not None:
        from ..config import ModelConfig
        from ..models.resolve import load_tokenizer
        v = ModelConfig.from_hf(model_dir).vocab_size
        tok = load_tokenizer(model_dir)
        if tok is not None:
            v = min(v, tok.get_vocab_size(with_added_tokens=True))
        return (min(1000, v // 2), v), f"vocabulary of {model_dir}"
    return FALLBACK_VOCAB_RANGE, "default (pass --vocab-range or --compare-offline for the model's)"


def run_offline(model_dir, prompts, output_len: int, max_num_seqs: int, device="cpu", dtype="auto",
                max_memory=None, memory_fraction=0.5, page_size=64, max_num_batched_tokens=2048,
                threads=None, progress=True) -> dict:
    """The same prompts through `LLM(...).engine`, every one queued at once, at most
    `max_num_seqs` running: output throughput, the median time of a step in which every
    running request decodes (the ITL equivalent), and the prefill of one prompt alone (median
    of 3; the TTFT at concurrency 1 equivalent). One untimed request warms the engine first.
    `threads`: torch threads, by default the engine process's rule (OURO_NUM_THREADS, else
    torch's default), so both sides compute with the same threads."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(threads or int(os.environ.get("OURO_NUM_THREADS", before)))
    try:
        return _run_offline(model_dir, prompts, output_len, max_num_seqs, device, dtype, max_memory, memory_fraction,
                            page_size, max_num_batched_tokens, progress)
    finally:
        torch.set_num_threads(before)


def _run_offline(model_dir, prompts, output_len, max_num_seqs, device, dtype, max_memory, memory_fraction,
                 page_size, max_num_batched_tokens, progress) -> dict:
    import torch
    from tqdm import tqdm

    from ..engine.llm import LLM
    from ..engine.sampling import SamplingParams
    llm = LLM(str(model_dir), device=device, dtype=dtype, max_memory=max_memory, memory_fraction=memory_fraction,
              max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, page_size=page_size)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    engine.add_request({"prompt_token_ids": prompts[0]}, params)
    _drain(engine)
    bar = tqdm(total=len(prompts), desc="offline", disable=not progress)
    steps, n_out = [], 0
    start = time.perf_counter()
    for p in prompts:
        engine.add_request({"prompt_token_ids": p}, params)
    while engine.has_unfinished():
        s = engine.scheduler
        decoding = bool(s.running) and all(r.num_computed == r.num_tokens - 1 for r in s.running) and \
            (not s.waiting or len(s.running) >= max_num_seqs)
        t = time.perf_counter()
        outs = engine.step()
        steps.append((time.perf_counter() - t, decoding))
        for o in outs:
            if o.finished:
                n_out += len(o.token_ids)
                bar.update(1)
    elapsed = time.perf_counter() - start
    bar.close()
    decode = [t for t, d in steps if d]

    def one_prefill():
        t = time.perf_counter()
        engine.add_request({"prompt_token_ids": prompts[0]}, SamplingParams(temperature=0, max_tokens=1,
                                                                               ignore_eos=True))
        _drain(engine)
        return time.perf_counter() - t
    prefill = statistics.median(one_prefill() for _ in range(3))
    return {"model": str(model_dir), "max_num_seqs": max_num_seqs, "page_size": page_size,
            "max_num_batched_tokens": max_num_batched_tokens, "max_memory": max_memory, "device": device,
            "threads": torch.get_num_threads(),
            "dtype": str(engine.model.embed_tokens.weight.dtype).replace("torch.", ""),
            "duration_s": elapsed, "output_tokens": n_out, "output_throughput": n_out / elapsed,
            "steps": len(steps), "decode_steps": len(decode),
            "decode_step_ms": 1e3 * statistics.median(decode) if decode else None,
            "prefill_tokens": len(prompts[0]), "prefill_ms": 1e3 * prefill}


def speculative_metrics(base_url: str, api_key: str | None = None) -> dict | None:
    """The server's speculation figures from /metrics (None when it does not speculate):
    accept length and the acceptance of each draft position, as SGLang's bench prints them."""
    import re

    import httpx
    try:
        text = httpx.get(base_url.rstrip("/") + "/metrics", timeout=10,
                         headers={"Authorization": f"Bearer {api_key}"} if api_key else None).text
    except httpx.HTTPError:
        return None
    length = re.search(r"^ouro:spec_accept_length\{[^}]*\} (\S+)", text, re.M)
    if length is None:
        return None
    at = sorted((int(m.group(1)), float(m.group(2))) for m in re.finditer(
        r'^ouro:spec_accept_rate_per_position\{[^}]*position="(\d+)"[^}]*\} (\S+)', text, re.M))
    return {"accept_length": float(length.group(1)), "accept_rate_per_position": [v for _, v in at]}


def _drain(engine) -> None:
    while engine.has_unfinished():
        engine.step()


def bench_serve(args) -> dict:
    model_dir = None
    if args.compare_offline:
        from ..models.resolve import resolve_model
        model_dir = resolve_model(args.compare_offline)
    info = served_model(args.base_url, args.api_key)
    model = args.model or info.get("id")
    rng, rng_from = vocab_range(args.vocab_range, model_dir)
    prompts, endpoint = workload_prompts(args, rng)
    load_start = os.getloadavg()[0]
    with span("load", cat="bench"):
        records, duration = asyncio.run(run_load(args.base_url, endpoint, model, prompts, args.output_len,
                                                 args.request_rate, args.max_concurrency, args.seed, args.api_key,
                                                 progress=not args.disable_tqdm))
    recs = [r.to_dict() for r in records]
    r = {"backend": "openai", "base_url": args.base_url, "endpoint": endpoint, "model": model,
         "num_prompts": args.num_prompts, "random_input_len": args.input_len, "random_output_len": args.output_len,
         "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
         "max_concurrency": args.max_concurrency, "seed": args.seed, "vocab_range": list(rng),
         "vocab_range_from": rng_from, "metrics": calculate_metrics(recs, duration), "requests": recs}
    spec = speculative_metrics(args.base_url, args.api_key)
    if spec is not None and spec["accept_length"] > 0:
        r["speculative"] = spec
    errors = sorted({x["error"] for x in recs if x["error"]})
    if errors:
        r["errors"] = errors[:10]
    if model_dir is not None:
        r["offline"] = run_offline(model_dir, prompts, args.output_len, args.offline_max_num_seqs or
                                   args.max_concurrency or args.num_prompts, args.device, args.dtype,
                                   args.offline_max_memory, args.offline_mem_fraction_static,
                                   args.offline_page_size, args.offline_max_num_batched_tokens,
                                   args.offline_threads, progress=not args.disable_tqdm)
        r["ratios"] = overhead_ratios(r["metrics"], r["offline"])
    r["load_average"] = [load_start, os.getloadavg()[0]]
    return r


def _row(label, value, fmt="{:.2f}") -> str:
    return "{:<40} {:<10}".format(label, "n/a" if value is None else fmt.format(value) if fmt else value)


def format_serve(r: dict) -> str:
    m = r["metrics"]
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
             _row("Traffic request rate:", r["request_rate"], None),
             _row("Max request concurrency:", r["max_concurrency"] or "unlimited", None),
             _row("Successful requests:", m["completed"], None), _row("Failed requests:", m["failed"], None),
             _row("Benchmark duration (s):", m["duration_s"]),
             _row("Total input tokens:", m["total_input_tokens"], None),
             _row("Total generated tokens:", m["total_output_tokens"], None),
             _row("Request throughput (req/s):", m["request_throughput"]),
             _row("Input token throughput (tok/s):", m["input_throughput"]),
             _row("Output token throughput (tok/s):", m["output_throughput"]),
             _row("Total token throughput (tok/s):", m["total_token_throughput"])]
    if r.get("speculative"):
        sp = r["speculative"]
        lines.append(_row("Accept length:", sp["accept_length"]))
        lines.append(_row("Acceptance per draft position:", ", ".join(
            f"{100 * a:.0f}%" for a in sp["accept_rate_per_position"]), None))
    for key, title, short in LATENCIES:
        s = m[f"{key}_ms"]
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        lines += [_row(f"Mean {short} (ms):", s["mean"]), _row(f"Median {short} (ms):", s["median"]),
                  _row(f"P99 {short} (ms):", s["p99"])]
    if "offline" in r:
        o, q = r["offline"], r["ratios"]
        lines += ["{s:{c}^{n}}".format(s=f" Offline engine (max_num_seqs {o['max_num_seqs']}) ", n=50, c="-"),
                  _row("Offline duration (s):", o["duration_s"]),
                  _row("Offline generated tokens:", o["output_tokens"], None),
                  _row("Offline output throughput (tok/s):", o["output_throughput"]),
                  _row("Offline median decode step (ms):", o["decode_step_ms"]),
                  _row("Offline torch threads:", o["threads"], None),
                  _row(f"Offline prefill, 1 x {o['prefill_tokens']} tok (ms):", o["prefill_ms"]),
                  "{s:{c}^{n}}".format(s=" Server / offline ", n=50, c="-"),
                  _row("Output throughput ratio:", q["output_throughput"], "{:.3f}"),
                  _row("Median ITL / decode step:", q["itl_over_decode_step"], "{:.3f}"),
                  _row("Median TTFT / prefill of 1 prompt:", q["ttft_over_prefill"], "{:.3f}")]
    lines.append("=" * 50)
    if r.get("errors"):
        lines.append("errors: " + "; ".join(r["errors"]))
    return "\n".join(lines)
