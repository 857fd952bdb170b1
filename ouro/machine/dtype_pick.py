"""`--dtype auto`: the fastest dtype whose GEMM this machine runs natively, found by timing.

Development machines differ: on one CPU bf16 GEMM runs 4x faster than fp32, on another it crawls
at 1 GFLOP/s (emulated). So `auto` times a few GEMMs of serving shapes in float32 and bfloat16 on
the device and picks bfloat16 only where it beats float32 by `NATIVE_GAIN` (a 16-bit type with
half the bytes must win clearly to be worth its rounding). The result is cached per machine
(device name, CPU model, thread count, torch version) in `$OURO_CACHE/dtype_auto.json`, so the
timing runs once. `OURO_DTYPE_AUTO=float32` pins the answer (the test suite does: exactness
checks run in float32 everywhere). Kept only where the machine was quiet while timed (`load`)."""

from __future__ import annotations

import os
import time

from .. import machine_cache
from ..machine_cache import machine_key
from .load import OtherLoad, keep, one_at_a_time, settled

CANDIDATES = ("bfloat16", "float32")
NATIVE_GAIN = 1.3
# (rows, in, out): a decode batch and a prefill chunk through a projection of serving width
SHAPES = ((32, 1024, 1024), (256, 1024, 1024))


def gemm_rate(dtype_name: str, device: str, budget_s: float = 0.15) -> float:
    """Median FLOP/s over SHAPES, each timed for about `budget_s` after a warm-up."""
    import torch
    dtype = getattr(torch, dtype_name)
    rates = []
    for m, k, n in SHAPES:
        a = torch.randn(m, k, device=device).to(dtype)
        b = torch.randn(k, n, device=device).to(dtype)
        a @ b
        _sync(device)
        reps, start = 0, time.perf_counter()
        while True:
            a @ b
            reps += 1
            _sync(device)
            spent = time.perf_counter() - start
            if spent >= budget_s or reps >= 10_000:
                break
        rates.append(2 * m * k * n * reps / spent)
    return sorted(rates)[len(rates) // 2]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch
        torch.cuda.synchronize(device)


def choose(rates: dict[str, float]) -> str:
    """The rule: bfloat16 where it beats float32 by NATIVE_GAIN, else float32."""
    if rates.get("bfloat16", 0.0) >= NATIVE_GAIN * rates["float32"]:
        return "bfloat16"
    return "float32"


FILE = "dtype_auto.json"
FORMAT = 2          # 2: timed on a quiet machine (`load.keep`); older entries are timed again


def pick_dtype(device: str = "cpu") -> str:
    """The dtype `auto` means on this machine (measured once, then read from the cache)."""
    pinned = os.environ.get("OURO_DTYPE_AUTO")
    if pinned:
        if pinned not in CANDIDATES + ("float16",):
            raise ValueError(f"OURO_DTYPE_AUTO must be one of float32, bfloat16, float16, got {pinned!r}")
        return pinned
    key = machine_key(device)
    with one_at_a_time(FILE):
        hit = machine_cache.read(FILE).get(key, {})
        if hit.get("dtype") in CANDIDATES and hit.get("format") == FORMAT and settled(hit):
            return hit["dtype"]
        with OtherLoad() as others:
            rates = {name: gemm_rate(name, device) for name in CANDIDATES}
        entry = {"dtype": choose(rates), "gflop_s": {k: round(v / 1e9, 2) for k, v in rates.items()},
                 "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "format": FORMAT}
        return keep(FILE, key, entry, others)["dtype"]


def cached_entry(device: str = "cpu") -> dict | None:
    """What the cache holds for this machine (for `ouro bench` to print), or None."""
    return machine_cache.read(FILE).get(machine_key(device))
