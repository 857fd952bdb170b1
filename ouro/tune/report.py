"""What `ouro tune` prints and writes: the lab finding behind each option (measured here, before
the search: the decode step's bytes by kind, the GEMM rates behind `--dtype auto`), the journal
as a table, and the ablation as the reference stack would
publish it: each kept option's share of the end-to-end gain."""

from __future__ import annotations


def motivations(model_dir, workload) -> dict:
    """{option: the measured finding that makes it worth trying on this machine}."""
    from ..machine.dtype_pick import cached_entry
    from ..models.loader import load_model
    from ..measure.step_cost import decode_cost
    model = load_model(model_dir)
    cost = decode_cost(model, workload.input_len + workload.output_len // 2, workload.concurrency)
    wb, cb = cost.weight_bytes, cost.cache_bytes
    total = wb + cb
    rates = (cached_entry("cpu") or {}).get("gflop_s", {})
    return {
        "dtype": (f"GEMM rates measured for --dtype auto: {', '.join(f'{k} {v:.1f} GFLOP/s' for k, v in rates.items())}"
                  if rates else "16-bit weights halve the decode step's weight bytes"),
        "quantization": f"weights are {wb / total:.0%} of a decode step's bytes (batch {workload.concurrency}): "
                        "int8 moves a quarter of float32's",
        "kv_cache_dtype": f"cache rows and KDA state are {cb / total:.1%} of a decode step's bytes",
        "compile": "per-op Python and dispatch between the decode step's small kernels",
        "max_num_batched_tokens": "the step mix: prefill chunks against decode steps of the running batch",
        "page_size": "pages gathered per attended row; larger pages, fewer gathers and more padding",
        "speculation": "a decode step is weight-bound: verifying K drafts reads the weights once",
        "parallelism": "two ranks each read half the weights, at the price of two all-reduces a layer",
    }


def format_journal(entries: list[dict]) -> str:
    lines = ["| option | choice | check | A/B (candidate vs best) | kept / why |", "|---|---|---|---|---|"]
    for e in entries:
        ab = e.get("ab")
        abtxt = (f"{ab['verdict']}, {'TTFT' if ab.get('objective') == 'ttft' else 'time'} ratio {ab['ratio']:.3f} [{ab['low']:.3f}, {ab['high']:.3f}], noise "
                 f"{ab['noise']:.1%}" if ab else "not timed")
        if ab and ab.get("ttft_s") and None not in ab["ttft_s"].values() and None not in ab["decode_step_s"].values():
            t, d = ab["ttft_s"], ab["decode_step_s"]
            abtxt += (f"; median TTFT {1e3 * t['a']:.0f} -> {1e3 * t['b']:.0f} ms, ITL {1e3 * d['a']:.1f} -> "
                      f"{1e3 * d['b']:.1f} ms")
        lines.append(f"| {e['option']} | {e['choice']} | {e.get('check', '-')} | {abtxt} | "
                     f"{'kept' if e['kept'] else e['why']} |")
    return "\n".join(lines)


def format_ablation(ab: dict, why: dict) -> str:
    t = ab["total"]["ab"]
    lines = [f"end to end: tuned vs baseline {t['median_a_s'] / t['median_b_s']:.2f}x the throughput "
             f"({t['output_tok_s']['b']:.1f} vs {t['output_tok_s']['a']:.1f} output tokens/s; {t['verdict']}, "
             f"noise {t['noise']:.1%})",
             "| removed from the winner | its choice | winner's time / without it | share of the gain | lab finding |",
             "|---|---|---|---|---|"]
    for r in ab["rows"]:
        a = r["ab"]
        share = f"{r['share']:.0%}" if r.get("share") is not None else "-"
        lines.append(f"| {r['option']} | {r['choice']} | {a['median_b_s'] / a['median_a_s']:.3f} | {share} | "
                     f"{why.get(r['option'], '')} |")
    if ab.get("removals_over_total") is not None:
        lines.append(f"the removals' savings add up to {ab['removals_over_total']:.0%} of the end-to-end saving "
                     "(measured apart: interactions and noise)")
    return "\n".join(lines)
