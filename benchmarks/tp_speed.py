"""Tensor parallelism on one machine: `small` at TP = 2 (two processes, one thread each) against
TP = 1 (one process, two threads), interleaved rounds, medians. Each run loads the checkpoint on
its ranks, prefills a batch of prompts and decodes greedily (`ouro.parallel.tp_check`); printed:
prefill and decode seconds, the TP=2/TP=1 ratio, the share of rank 0's time inside collectives
(all-reduce / all-gather over gloo), weights and KDA state per rank, and the tokens checked equal.

    python benchmarks/tp_speed.py [--model small] [--rounds 3] [--batch 4] [--prompt-len 128] [--steps 16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from ouro.models.resolve import resolve_model  # noqa: E402
from ouro.parallel.tp_check import run  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="small")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--ep", action="store_true", help="experts whole per rank at TP = 2")
    a = p.parse_args()
    d = resolve_model(a.model)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 1000, (a.prompt_len,), generator=g).tolist() for _ in range(a.batch)]
    runs = {1: [], 2: []}
    for _ in range(a.rounds):
        for tp, threads in ((1, 2), (2, 1)):
            runs[tp].append(run(d, prompts, a.steps, tp=tp, ep=a.ep and tp > 1, threads=threads))
    one, two = runs[1][-1], runs[2][-1]
    print(f"{a.model}: batch {a.batch} x {a.prompt_len} tokens, {a.steps} decode steps, float32, {a.rounds} rounds "
          f"interleaved (TP=1: 1 process x 2 threads; TP=2: 2 processes x 1 thread{', experts whole per rank' if a.ep else ''})")
    print(f"  tokens equal: {torch.equal(one['tokens'], two['tokens'])}; logits rel RMS "
          f"{((two['logits'] - one['logits']).norm() / one['logits'].norm()).item():.2e}")
    for phase in ("prefill", "decode"):
        t1 = statistics.median(r["seconds"][phase] for r in runs[1])
        t2 = statistics.median(r["seconds"][phase] for r in runs[2])
        comm = statistics.median(r["seconds"][f"{phase}_collectives"] for r in runs[2])
        per = f" ({1e3 * t2 / a.steps:.1f} vs {1e3 * t1 / a.steps:.1f} ms per step)" if phase == "decode" else ""
        print(f"  {phase:8s} TP=1 {t1:.3f} s  TP=2 {t2:.3f} s  ratio TP=1/TP=2 {t1 / t2:.2f}x{per}; "
              f"rank 0 in collectives {comm:.3f} s ({100 * comm / t2:.0f}%), computing {t2 - comm:.3f} s")
    print(f"  weights per rank: TP=1 {one['weight_bytes'] / 2**20:.1f} MiB, TP=2 {two['weight_bytes'] / 2**20:.1f} MiB "
          f"({two['weight_bytes'] / one['weight_bytes']:.2f}); KDA state {one['state_bytes'] / 2**20:.2f} -> "
          f"{two['state_bytes'] / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
