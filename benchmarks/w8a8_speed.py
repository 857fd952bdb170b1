"""W8A8 against the fastest unquantised form on this machine, measured side by side in one run
(interleaved rounds, medians):

1. the products: ouro's fused W8A8 kernel (quantise rows, exact int8 products, scales) against
   float32 (`F.linear` and oneDNN's packed weight, the faster of the two) and torch's fbgemm
   `quantized::linear_dynamic` (per-tensor activation scale: the speed to match, not a kernel
   ouro may ship), over distinct weight copies (weights stream from memory, as in a model step);
   GB/s of int8 weight bytes against the machine's streaming bandwidth;
2. the model: `small`, a decode step at batch 16 and a prefill of 16 x 128 tokens, float32
   (its measured forms) against W8A8, with the A/B verdict.

    python benchmarks/w8a8_speed.py [--rounds 7] [--skip-model]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ouro.machine import gemm_pick  # noqa: E402
from ouro.measure.ab import verdict_from_times  # noqa: E402
from ouro.measure.roofline import Roofline  # noqa: E402
from ouro.ops.quant import quantize_rows  # noqa: E402
from ouro.quant.int8_native import native  # noqa: E402
from ouro.quant.w8a8 import W8A8Linear  # noqa: E402

STREAM_BYTES = 64 << 20        # fp32 bytes of distinct weight copies per timing pass


def product_variants(n: int, k: int):
    copies = max(1, min(64, STREAM_BYTES // (4 * n * k)))
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, k, generator=g) for _ in range(copies)]
    packs = [gemm_pick.pack(w) for w in ws] if gemm_pick.packable(ws[0]) else None
    qs = [quantize_rows(w) for w in ws]
    fb = [torch.ops.quantized.linear_prepack(   # (torch warns that quantized tensors are deprecated)
        torch.quantize_per_channel(w, s, torch.zeros(n, dtype=torch.long), 0, torch.qint8), None)
        for w, (_, s) in zip(ws, qs)]
    layers = [W8A8Linear(q, s, forms=["native"] * 3) for q, s in qs] if native() is not None else None

    def run(f):
        return lambda x: [f(x, i) for i in range(copies)]
    variants = {"fp32 linear": run(lambda x, i: F.linear(x, ws[i]))}
    if packs:
        variants["fp32 packed"] = run(lambda x, i: gemm_pick.product(x, None, "packed", packs[i]))
    variants["fbgemm dynamic"] = run(lambda x, i: torch.ops.quantized.linear_dynamic(x, fb[i], True))
    if layers:
        variants["ouro w8a8"] = run(lambda x, i: layers[i](x))
    return variants, copies


def time_products(shapes, rows_list, rounds):
    print("## int8 products (per product; weights streamed from memory)\n")
    bw = Roofline.measure().bytes_per_s / 2          # copy bandwidth counts read + write: streaming read rate
    print(f"machine streaming bandwidth (copy / 2): {bw / 1e9:.1f} GB/s\n")
    print("| N x K | rows | fp32 best us | fbgemm dynamic us | ouro w8a8 us | ouro / fp32 | ouro / fbgemm | ouro int8 GB/s | % of stream |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n, k in shapes:
        variants, copies = product_variants(n, k)
        for rows in rows_list:
            x = torch.randn(rows, k)
            times = {name: [] for name in variants}
            for f in variants.values():
                f(x)                                   # warm-up
            for _ in range(rounds):
                for name, f in variants.items():
                    t = time.perf_counter()
                    f(x)
                    times[name].append((time.perf_counter() - t) / copies)
            med = {name: statistics.median(v) for name, v in times.items()}
            fp32 = min(v for name, v in med.items() if name.startswith("fp32"))
            ouro = med.get("ouro w8a8", float("nan"))
            gbs = n * k / ouro / 1e9
            print(f"| {n} x {k} | {rows} | {fp32 * 1e6:.1f} | {med['fbgemm dynamic'] * 1e6:.1f} | {ouro * 1e6:.1f} | "
                  f"{ouro / fp32:.2f} | {ouro / med['fbgemm dynamic']:.2f} | {gbs:.1f} | {100 * gbs * 1e9 / bw:.0f}% |")
    print()


def time_model(rounds):
    from ouro.engine.simple_runner import SimpleRunner
    from ouro.models.loader import load_model
    from ouro.models.resolve import resolve_model
    from ouro.quant.w8a8 import quantize_model
    directory = resolve_model("small")
    models = {"float32": load_model(directory), "w8a8": load_model(directory)}
    quantize_model(models["w8a8"])
    batch, prompt = 16, 128
    prompts = [[(7 * i + 3 * j) % 30000 + 10 for j in range(prompt)] for i in range(batch)]
    times = {name: {"prefill": [], "decode": []} for name in models}
    with torch.inference_mode():
        for r in range(rounds + 1):
            for name in (models if r % 2 == 0 else reversed(list(models))):
                runner = SimpleRunner(models[name], batch, prompt + 8)
                t = time.perf_counter()
                logits = runner.step(prompts)
                t_prefill = time.perf_counter() - t
                nxt = [[int(i)] for i in logits.argmax(-1)]
                t = time.perf_counter()
                runner.step(nxt)
                t_decode = time.perf_counter() - t
                if r:                                  # round 0 warms up
                    times[name]["prefill"].append(t_prefill)
                    times[name]["decode"].append(t_decode)
    print("## `small`, float32 (measured forms) against W8A8, same run, interleaved\n")
    print("| step | float32 ms | w8a8 ms | speed-up | verdict |")
    print("|---|---|---|---|---|")
    for step in ("decode", "prefill"):
        a, b = times["float32"][step], times["w8a8"][step]
        v = verdict_from_times(a, b, "float32", "w8a8", paired=True)
        label = f"decode, batch {batch}" if step == "decode" else f"prefill, {batch} x {prompt}"
        print(f"| {label} | {1e3 * statistics.median(a):.1f} | {1e3 * statistics.median(b):.1f} | "
              f"{statistics.median(a) / statistics.median(b):.2f}x | {v.verdict} |")
    print()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--skip-model", action="store_true")
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}, ouro kernel: "
          f"{native().features() if native() else 'not built'}\n")
    time_products([(512, 512), (1024, 512), (512, 1024), (5632, 2048)], [1, 4, 16, 64], args.rounds)
    if not args.skip_model:
        time_model(args.rounds)


if __name__ == "__main__":
    main()
