"""The itemised roofline floor of a decode step and of a prefill (`ouro.measure.step_cost`), at the
machine rates given (e.g. the ones a benchmark run reported) or measured now.

    python benchmarks/step_floor.py --model small --batch 32 --context 290 --flops-per-s 327e9 --bytes-per-s 26.5e9
    python benchmarks/step_floor.py --model small --offline-json /tmp/off.json   # that run's rates and shapes

Also prints the floor by the accounting used before (FLOPs of every routed expert for every
token, every cached token of the context read), to show what changed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from ouro.measure.roofline import Roofline  # noqa: E402
from ouro.measure.step_cost import decode_cost, prefill_cost  # noqa: E402
from ouro.layers.context import ModelCache  # noqa: E402
from ouro.models.loader import load_model  # noqa: E402
from ouro.models.resolve import resolve_model  # noqa: E402


def previous_decode_floor(model, roof, context, batch):
    """The accounting replaced in ouro/bench/offline.py: 2*batch*(all parameters but the embedding)."""
    c = model.config
    n = sum(p.numel() for p in model.parameters())
    weight_bytes = 4 * (n - c.vocab_size * c.hidden_size) + 4 * batch * c.hidden_size
    cache_bytes = batch * (context * ModelCache.bytes_per_token(c) + 2 * ModelCache.bytes_per_slot(c))
    flops = 2 * batch * (n - c.vocab_size * c.hidden_size)
    return flops, weight_bytes + cache_bytes, roof.floor_s(flops, weight_bytes + cache_bytes)


def show(name, cost, roof):
    print(f"{name}: floor {1e3 * roof.floor_s(cost.flops, cost.bytes):.2f} ms = max(compute "
          f"{cost.flops / 1e9:.3f} GFLOP / {roof.flops_per_s / 1e9:.0f} GFLOP/s = "
          f"{1e3 * cost.flops / roof.flops_per_s:.2f} ms, "
          f"memory {cost.bytes / 2**20:.1f} MiB / {roof.bytes_per_s / 1e9:.1f} GB/s = "
          f"{1e3 * cost.bytes / roof.bytes_per_s:.2f} ms)")
    for kind in ("flops", "weight_bytes", "cache_bytes"):
        unit, scale = ("GFLOP", 1e9) if kind == "flops" else ("MiB", 2**20)
        print(f"  {kind}: " + ", ".join(f"{k} {v / scale:.3f} {unit}" for k, v in cost.parts[kind].items()))
    print(f"  expected distinct routed experts per MoE layer: {cost.parts['distinct_experts_per_layer']:.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=290, help="tokens each decoding sequence sees")
    ap.add_argument("--prefill", type=int, default=256, help="prefill length")
    ap.add_argument("--flops-per-s", type=float, default=None)
    ap.add_argument("--bytes-per-s", type=float, default=None)
    ap.add_argument("--offline-json", default=None, help="take rates, batch, context, prefill length from this run")
    a = ap.parse_args()
    if a.offline_json:
        r = json.loads(open(a.offline_json).read())
        a.flops_per_s, a.bytes_per_s = r["matmul_flops_per_s"], r["copy_bytes_per_s"]
        a.batch, a.context, a.prefill = r["decode_floor"]["batch"], r["decode_floor"]["context"], r["input_len"]
    model = load_model(resolve_model(a.model, progress=False))
    roof = Roofline.measure() if a.flops_per_s is None else Roofline(a.flops_per_s, a.bytes_per_s)
    show(f"decode step, batch {a.batch}, context {a.context}", decode_cost(model, a.context, a.batch), roof)
    show(f"prefill of {a.prefill} tokens", prefill_cost(model, a.prefill), roof)
    flops, nbytes, floor = previous_decode_floor(model, roof, a.context, a.batch)
    print(f"previous decode accounting: floor {1e3 * floor:.2f} ms = max({flops / 1e9:.3f} GFLOP, "
          f"{nbytes / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
