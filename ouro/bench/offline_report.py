"""The printed table of `ouro bench offline`: every figure comes from the result dict as is."""

from __future__ import annotations


def _floor_terms(flops, nbytes, r, low=0.0) -> str:
    compute = (f"compute {(flops - low) / 1e9:.2f} GFLOP at {r['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s = "
               f"{1e3 * (flops - low) / r['matmul_flops_per_s']:.1f} ms")
    if low and r.get("low_precision_ops_per_s"):
        rate = r["low_precision_ops_per_s"]
        compute += f" + {low / 1e9:.2f} GOP int8/fp8 at {rate / 1e9:.0f} GOP/s = {1e3 * low / rate:.1f} ms"
    return (f"max(memory {nbytes / 2**20:.0f} MiB at {r['copy_bytes_per_s'] / 1e9:.1f} GB/s = "
            f"{1e3 * nbytes / r['copy_bytes_per_s']:.1f} ms, {compute})")


def format_offline(r: dict) -> str:
    o = r["ouro"]
    lines = [f"offline: {r['num_prompts']} prompts x ({r['input_len']} in / {r['output_len']} out), "
             f"concurrency {r['concurrency']}, {r['device']} {r['dtype']}, load average "
             f"{r['load_average'][0]:.1f} at start, {r['load_average'][1]:.1f} at end",
             *([f"  dtype auto -> {r['dtype']}: GEMM GFLOP/s measured "
                + ", ".join(f"{k} {v:.1f}" for k, v in r["dtype_auto"]["gflop_s"].items())]
               if r.get("dtype_auto") else []),
             f"  ouro          {o['seconds']:8.2f} s  input {o['input_tok_s']:8.1f} tok/s  "
             f"output {o['output_tok_s']:7.1f} tok/s"]
    if r.get("speculative_stats"):
        sp = r["speculative_stats"]
        lines.append(f"  speculative {r['speculative']['speculative_algorithm']} K={r['speculative']['speculative_num_steps']}: "
                     f"accept length {sp['spec_accept_length']:.2f} tokens per verification, per draft position "
                     + ", ".join(f"{100 * a:.0f}%" for a in sp["spec_accept_rate_per_position"]))
    if "transformers" in r:
        t = r["transformers"]
        lines.append(f"  transformers  {t['seconds']:8.2f} s  input {t['input_tok_s']:8.1f} tok/s  "
                     f"output {t['output_tok_s']:7.1f} tok/s")
        lines.append(f"  ratio (output tok/s, ouro / transformers): {r['ratio']:.2f}x; "
                     f"identical greedy outputs: {100 * r['same_tokens']:.0f}%")
        lines.append("  per wave (ouro s / transformers s): " + ", ".join(
            f"{w['ouro_s']:.2f} / {w['transformers_s']:.2f}" for w in r["waves"]))
        if "verdict" in r:
            v = r["verdict"]
            lines.append(f"  A/B verdict: ouro is {v['verdict']} (wave time ratio {v['ratio']:.3f}, interval "
                         f"{v['low']:.3f}..{v['high']:.3f}, {v['repeats']} waves)")
    f = r["decode_floor"]
    if o["decode_step_s"]:
        lines.append(f"  decode step (batch {f['batch']}, context {f['context']}): {1e3 * o['decode_step_s']:.1f} ms "
                     f"(median of {o['decode_steps_timed']}); floor {1e3 * f['floor_s']:.1f} ms = "
                     f"{_floor_terms(f['flops'], f['weight_bytes'] + f['cache_bytes'] + f.get('activation_bytes', 0.0), r, f.get('low_precision_flops', 0.0))}: "
                     f"{r['decode_step_over_floor']:.1f}x the floor")
    p = r["prefill"]
    lines.append(f"  prefill of {p['tokens']} tokens: {1e3 * p['seconds']:.0f} ms; floor {1e3 * p['floor_s']:.1f} ms = "
                 f"{_floor_terms(p['flops'], p['bytes'], r, p.get('low_precision_flops', 0.0))}: {p['over_floor']:.1f}x the floor "
                 f"(ouro dispatches {p['dispatched_flops'] / 1e9:.2f} GFLOP)")
    s = o["steps"]
    lines.append(f"  steps: {s['with_prefill']} with prefill {s['with_prefill_s']:.2f} s, "
                 f"{s['decode_only']} decode-only {s['decode_only_s']:.2f} s")
    return "\n".join(lines)
