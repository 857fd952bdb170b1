"""Ops dispatched per decode step, eager against fused (`ouro.native`), counted by the lab's op
recorder on one decode step of the same model and cache, by part of the model.

    python benchmarks/decode_ops.py --model small --batch 16 --input-len 128

A CPU decode step of hundreds of tiny element-wise ops is dispatch-bound whatever its arithmetic:
each op costs a dispatch and, past a size, an OpenMP fork/join. "compute" counts the ops that do
work (views, allocation and metadata ops excluded), "all" every aten op dispatched. A fused op
counts once."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import Counter

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from ouro.engine.simple_runner import SimpleRunner  # noqa: E402
from ouro.lab.redundancy.op_record import OpRecorder  # noqa: E402
from ouro.models.loader import load_model  # noqa: E402
from ouro.models.resolve import resolve_model  # noqa: E402
from ouro.native.kernels import eager_only  # noqa: E402


def part_of(module: str) -> str:
    """layers.3.self_attn.q_proj -> self_attn (KDA or DSA by the layer), the model's own rows as they are."""
    m = re.match(r"layers\.\d+(\.([a-z_]+))?", module)
    return (m.group(2) or "layer glue") if m else module


def count_step(model, runner, tokens, eager: bool) -> tuple[Counter, Counter]:
    rec = OpRecorder(model, hash_inputs=False)
    with eager_only(eager), rec:
        runner.step(tokens)
    compute, every = Counter(), Counter()
    for r in rec.ops:
        every[part_of(r.module)] += 1
        if r.compute:
            compute[part_of(r.module)] += 1
    return compute, every


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    a = ap.parse_args()
    torch.manual_seed(0)
    model = load_model(resolve_model(a.model, progress=False), device="cpu", dtype=torch.float32)
    runner = SimpleRunner(model, a.batch, a.input_len + 4)
    V = model.config.vocab_size
    with torch.inference_mode():
        runner.step([torch.randint(1, V, (a.input_len,)).tolist() for _ in range(a.batch)])
        step = lambda: [[int(t)] for t in torch.randint(1, V, (a.batch,))]   # noqa: E731
        eager = count_step(model, runner, step(), eager=True)
        fused = count_step(model, runner, step(), eager=False)
    print(f"{a.model}, batch {a.batch}, context {a.input_len}: ops per decode step, eager -> fused")
    print("| part | compute ops | all ops dispatched |\n|---|---|---|")
    for part in sorted(set(eager[1]) | set(fused[1]), key=lambda p: -eager[1][p]):
        print(f"| {part} | {eager[0][part]} -> {fused[0][part]} | {eager[1][part]} -> {fused[1][part]} |")
    print(f"| total | {sum(eager[0].values())} -> {sum(fused[0].values())} | "
          f"{sum(eager[1].values())} -> {sum(fused[1].values())} |")


if __name__ == "__main__":
    main()
