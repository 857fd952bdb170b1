"""`ouro probe redundancy`: record the aten ops of one prefill and two decode steps and report
(1) computations repeated on identical inputs, (2) ops dispatched per step by module, (3) host
synchronisations inside the forward, (4) blocks doing much more work than their floor, or whose
work grows with context faster than the floor does.

Python API: `probe_redundancy(model="tiny", prompt_len=32, context=64, batch=1) -> list[Finding]`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..findings import Finding
from .host_sync import SyncWatch
from .op_record import OpRecorder
from .report import floor_findings, op_count_finding, repeat_findings, sync_findings

PROBE = "redundancy"


@dataclass
class CostModel:
    """Time of one op: a fixed dispatch/launch cost plus the slower of compute and memory traffic."""
    flops_per_s: float = 100e9
    bytes_per_s: float = 10e9
    op_overhead_s: float = 4e-6

    def op_time(self, op) -> float:
        return self.op_overhead_s + max(op.matmul_flops / self.flops_per_s, op.bytes / self.bytes_per_s)

    @classmethod
    def measure(cls) -> "CostModel":
        from ...measure.roofline import Roofline, median_time
        r = Roofline.measure()
        a, b = torch.ones(8), torch.ones(8)
        overhead = median_time(lambda: [torch.add(a, b) for _ in range(200)], repeats=5) / 200
        return cls(r.flops_per_s, r.bytes_per_s, overhead)


@dataclass
class StepRecord:
    label: str          # "prefill", "decode@64", ...
    context: int
    ops: list
    syncs: list
    io_bytes: dict
    seconds: float


def record_step(model, runner, tokens, label: str, context: int) -> StepRecord:
    rec = OpRecorder(model)
    watch = SyncWatch(rec)
    watch.step = label
    t0 = time.perf_counter()
    with rec, watch:
        runner.step(tokens)
    return StepRecord(label, context, rec.ops, watch.syncs, dict(rec.modules.io_bytes), time.perf_counter() - t0)


def record_steps(model, prompt_len: int, contexts: tuple[int, ...], batch: int, seed: int = 0) -> list[StepRecord]:
    """A recorded prefill of `prompt_len` tokens per sequence, then decode steps recorded at each of
    `contexts` (the decode token is token number `context`; the tokens between are fed unrecorded).
    The decode steps are recorded on their capturable path (`ops.capture.capture_path`): what a
    compiled or CUDA-graph step runs, where a host sync is a fault; on a CPU, eager ops may also
    read counts on the host, which waits for nothing."""
    from ...engine.simple_runner import SimpleRunner
    from ...ops.capture import capture_path
    gen = torch.Generator().manual_seed(seed)
    V = model.config.vocab_size
    draw = lambda n: [torch.randint(1, V, (n,), generator=gen).tolist() for _ in range(batch)]
    steps = [record_step(model, SimpleRunner(model, batch, prompt_len), draw(prompt_len), "prefill", prompt_len)]
    runner = SimpleRunner(model, batch, max(contexts))
    have = 0
    for c in sorted(contexts):
        if c - 1 > have:
            runner.step(draw(c - 1 - have))
        with capture_path():
            steps.append(record_step(model, runner, draw(1), f"decode@{c}", c))
        have = c
    return steps


def probe_model(model, prompt_len: int = 32, context: int = 64, batch: int = 1, cost: CostModel | None = None,
                growth: int = 4) -> list[Finding]:
    """All four analyses on a built model (decode at `context` and `growth * context`)."""
    cost = cost or CostModel()
    contexts = (context, growth * context)
    steps = record_steps(model, prompt_len, contexts, batch)
    prefill, decodes = steps[0], steps[1:]
    syncs = sync_findings(decodes[0], prefill)
    repeats = [f for step in (decodes[0], prefill) for f in repeat_findings(step, cost)]
    floors = floor_findings(model, decodes, batch, cost)
    # importance within a severity: host syncs (most per step first: they block graph capture),
    # then wasted work (largest first). Findings ouro already had are set apart by a baseline
    # (`ouro probe redundancy --baseline clean.json`), not by a list kept here.
    waste = sorted([f for f in repeats + floors if f.severity == "warning"],
                   key=lambda f: -(f.measured or {}).get("wasted_us", 0.0))
    findings = syncs + waste + [f for f in repeats + floors if f.severity != "warning"]
    findings.append(op_count_finding(decodes[0], prefill, cost))
    for f in findings:
        f.probe = PROBE
    return findings


def probe_redundancy(model: str = "tiny", prompt_len: int = 32, context: int = 64, batch: int = 1,
                     dtype: str = "float32", measure: bool = False, graph: bool = False,
                     fused: bool = True) -> list[Finding]:
    """Load a preset or checkpoint directory and run the probe; findings in order of importance.
    graph: also trace the compiled decode step (`graph_check`) and report whether it is one graph.
    fused=False: the steps run the eager code every fused op keeps as its reference (what a machine
    without a compiler runs), so the work of that code is what is weighed."""
    from contextlib import nullcontext

    from ...models.loader import load_model
    from ...models.resolve import resolve_model
    from ...native.kernels import eager_only
    m = load_model(resolve_model(model, progress=False), dtype=getattr(torch, dtype))
    with nullcontext() if fused else eager_only():
        findings = probe_model(m, prompt_len, context, batch, CostModel.measure() if measure else CostModel())
    if graph:
        from .graph_check import graph_finding
        f = graph_finding(m)
        f.probe = PROBE
        findings.insert(0 if f.severity != "info" else len(findings), f)
    return findings


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny", help="preset name or checkpoint directory (default tiny)")
    p.add_argument("--prompt-len", type=int, default=32, help="tokens per sequence of the recorded prefill")
    p.add_argument("--context", type=int, default=64,
                   help="context of the recorded decode step; a second one runs at 4x this")
    p.add_argument("--batch", type=int, default=1, help="sequences per step")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    p.add_argument("--measure", action="store_true",
                   help="time ops with this machine's measured roofline (default: a fixed cost model, so "
                        "findings do not depend on the machine)")
    p.add_argument("--spec", default=None, metavar="nextn:K",
                   help="also run held-out prompts with MTP speculation (K drafts) and report the draft work thrown "
                        "away (a checkpoint with an MTP layer, e.g. tiny-py): info while the engine accepts what the "
                        "draft layer driven from scratch on the same tokens accepts, a warning when it departs")
    p.add_argument("--fused", default="on", choices=["on", "off"],
                   help="off: weigh the eager code the fused native ops keep as their reference (the path a "
                        "machine without a compiler runs)")
    p.add_argument("--graph", action="store_true",
                   help="also trace the compiled decode step (--compile's graph, aot_eager) at two batch sizes "
                        "and report whether it is one graph with no break")


def run(args) -> list[Finding]:
    findings = probe_redundancy(args.model, args.prompt_len, args.context, args.batch, args.dtype,
                                measure=args.measure, graph=args.graph, fused=args.fused == "on")
    if args.spec:
        from ..numerics.run_configs import parse_config
        from .spec_waste import spec_waste_finding
        f = spec_waste_finding(args.model, parse_config(f"spec={args.spec}").spec_steps, dtype=args.dtype)
        findings.insert(0 if f.severity != "info" else len(findings), f)
    return findings
