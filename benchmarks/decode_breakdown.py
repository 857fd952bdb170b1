"""Where a decode step's time goes: module forward hooks around each part of the model, on the
engine's own decode steps (same engine settings as `ouro bench offline`).

    python benchmarks/decode_breakdown.py --model small --batch 32 --input-len 256 --steps 8

Plain and hooked steps are interleaved; each row is a median over the hooked steps of the time
spent in that part and nowhere else (rows add up to the hooked step), with the aten ops it
dispatches (one extra, counted step). The plain step's median is printed against the total, so
the hooks' own cost shows. The routed-expert row also gives its weight bytes per second.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from ouro.measure.roofline import Roofline  # noqa: E402
from ouro.measure.step_cost import decode_cost  # noqa: E402
from ouro.config import EngineConfig  # noqa: E402
from ouro.engine.llm_engine import LLMEngine  # noqa: E402
from ouro.engine.sampling import SamplingParams  # noqa: E402
from ouro.models.loader import load_model  # noqa: E402
from ouro.models.resolve import resolve_model  # noqa: E402

# "outside the timed modules": the engine (scheduling, metadata, sampling) and the model's own glue
ROWS = ["routed experts", "router", "MoE combine", "shared expert + dense MLP", "KDA", "DSA without indexer",
        "DSA indexer", "mHC weights (Sinkhorn)", "mHC merge + layer glue", "norms", "embedding + head",
        "outside the timed modules"]


def parts(model):
    """(module, row) pairs: every timed module and the row its *own* time (minus timed children) goes to."""
    out = [(model, "outside the timed modules"), (model.embed_tokens, "embedding + head"),
           (model.lm_head, "embedding + head"), (model.norm, "norms")]
    for layer in model.layers:
        out += [(layer, "mHC merge + layer glue"), (layer.attn_hc, "mHC weights (Sinkhorn)"),
                (layer.ffn_hc, "mHC weights (Sinkhorn)"), (layer.input_layernorm, "norms"),
                (layer.post_attention_layernorm, "norms")]
        a = layer.self_attn
        if layer.is_kda:
            out.append((a, "KDA"))
        else:
            out.append((a, "DSA without indexer"))
            if a.indexer is not None:
                out.append((a.indexer, "DSA indexer"))
        m = layer.mlp
        if hasattr(m, "experts"):
            out += [(m, "MoE combine"), (m.gate, "router"), (m.experts, "routed experts"),
                    (m.shared_experts, "shared expert + dense MLP")]
        else:
            out.append((m, "shared expert + dense MLP"))
    return out


class Timer:
    """Hooks that charge each timed module's time, minus its timed children's, to its row."""

    def __init__(self, model, device):
        self.sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
        self.stack, self.seconds, self.ops, self.handles = [], defaultdict(float), defaultdict(int), []
        for module, row in parts(model):
            if module is model:     # the model's own row is filled in from the step time
                continue
            self.handles.append(module.register_forward_pre_hook(self._enter(row)))
            self.handles.append(module.register_forward_hook(self._leave))

    def _enter(self, row):
        def hook(module, args):
            self.sync()
            self.stack.append([row, time.perf_counter(), 0.0])
        return hook

    def _leave(self, module, args, out):
        self.sync()
        row, start, children = self.stack.pop()
        spent = time.perf_counter() - start
        self.seconds[row] += spent - children
        if self.stack:
            self.stack[-1][2] += spent

    def row(self):
        return self.stack[-1][0] if self.stack else "outside the timed modules"

    def remove(self):
        for h in self.handles:
            h.remove()


class OpCounter(TorchDispatchMode):
    def __init__(self, timer):
        super().__init__()
        self.timer = timer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.timer.ops[self.timer.row()] += 1
        return func(*args, **(kwargs or {}))


def in_decode(engine, batch):
    s = engine.scheduler
    return len(s.running) == batch and not s.waiting and all(r.num_computed == r.num_tokens - 1 for r in s.running)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8, help="hooked steps (as many plain ones interleaved)")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    model = load_model(resolve_model(a.model, progress=False), device=a.device,
                       dtype=EngineConfig(device=a.device).torch_dtype())
    cfg = EngineConfig(device=a.device, max_num_seqs=a.batch, max_num_batched_tokens=max(2048, a.input_len),
                       page_size=64, max_model_len=a.input_len + 2 * a.steps + 8)
    engine = LLMEngine(model, None, cfg, verbose=False)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=2 * a.steps + 8, ignore_eos=True)
    for _ in range(a.batch):
        engine.add_request({"prompt_token_ids": torch.randint(0, model.config.vocab_size, (a.input_len,),
                                                              generator=g).tolist()}, params)
    while not in_decode(engine, a.batch):
        engine.step()
    engine.step()   # warm-up decode step
    plain, hooked, per_row = [], [], defaultdict(list)
    contexts = []
    for _ in range(a.steps):
        contexts.append(statistics.mean(r.num_tokens for r in engine.scheduler.running))
        t = time.perf_counter()
        engine.step()
        plain.append(time.perf_counter() - t)
        timer = Timer(model, a.device)
        t = time.perf_counter()
        engine.step()
        total = time.perf_counter() - t
        timer.remove()
        hooked.append(total)
        timer.seconds["outside the timed modules"] = total - sum(timer.seconds.values())
        for row in ROWS:
            per_row[row].append(timer.seconds.get(row, 0.0))
    timer = Timer(model, a.device)
    with OpCounter(timer):
        engine.step()
    timer.remove()

    print(f"decode step breakdown: {a.model}, batch {a.batch}, context ~{statistics.mean(contexts):.0f}, "
          f"{a.device}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}; "
          f"medians of {a.steps} hooked steps")
    print("| part | ms | share | aten ops |\n|---|---|---|---|")
    total_ms = 1e3 * statistics.median(hooked)
    for row in ROWS:
        ms = 1e3 * statistics.median(per_row[row])
        print(f"| {row} | {ms:.1f} | {100 * ms / total_ms:.0f}% | {timer.ops.get(row, 0)} |")
    print(f"| **sum of medians** | {sum(1e3 * statistics.median(v) for v in per_row.values()):.1f} | | "
          f"{sum(timer.ops.values())} |")
    print(f"hooked step (median): {total_ms:.1f} ms; plain step without hooks (median, interleaved): "
          f"{1e3 * statistics.median(plain):.1f} ms")
    roof = Roofline.measure(a.device, model.embed_tokens.weight.dtype)
    cost = decode_cost(model, round(statistics.mean(contexts)), a.batch)
    expert_bytes = cost.parts["weight_bytes"]["routed_experts"]
    ms = 1e3 * statistics.median(per_row["routed experts"])
    print(f"routed experts: {expert_bytes / 1e6:.0f} MB of expert weights touched (expected) in {ms:.1f} ms = "
          f"{expert_bytes / ms / 1e6:.1f} GB/s; measured copy bandwidth {roof.bytes_per_s / 1e9:.1f} GB/s; "
          f"step floor {1e3 * roof.floor_s(cost.flops, cost.bytes):.1f} ms")


if __name__ == "__main__":
    main()
