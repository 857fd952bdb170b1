"""The machine's roofline, measured at start-up: matmul FLOP/s and memory copy bandwidth."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode


def _times(fn, repeats: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def median_time(fn, repeats: int = 5, warmup: int = 1) -> float:
    return statistics.median(_times(fn, repeats, warmup))


def fastest_time(fn, repeats: int = 9, warmup: int = 1) -> float:
    """The fastest of `repeats` runs: a rate for a floor is the best the machine reaches (on a shared
    VM the median of 7 copies moved 36-46 GB/s and the matmul 120-180 GFLOP/s within a minute)."""
    return min(_times(fn, repeats, warmup))


@dataclass
class Roofline:
    flops_per_s: float     # dense fp32 matmul rate
    bytes_per_s: float     # large-tensor copy bandwidth (read + write counted)
    low_flops_per_s: float | None = None    # int8 / e4m3 product rate, where a step has such products

    @classmethod
    def measure(cls, device="cpu", dtype=torch.float32) -> "Roofline":
        a = torch.randn(1024, 1024, device=device, dtype=dtype)
        b = torch.randn(1024, 2048, device=device, dtype=dtype)
        sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)

        def mm():
            a @ b
            sync()
        t_mm = fastest_time(mm)
        src = torch.empty(32 << 20, device=device, dtype=torch.float32)  # 128 MiB
        dst = torch.empty_like(src)

        def cp():
            dst.copy_(src)
            sync()
        t_cp = fastest_time(cp)
        return cls(flops_per_s=2 * 1024 * 1024 * 2048 / t_mm, bytes_per_s=2 * src.nbytes / t_cp)

    def compute_s(self, flops: float, low_flops: float = 0.0) -> float:
        """Compute time: `low_flops` of the `flops` at the low-precision rate, the rest at float's."""
        low_rate = self.low_flops_per_s or self.flops_per_s
        return (flops - low_flops) / self.flops_per_s + low_flops / low_rate

    def floor_s(self, flops: float, bytes_moved: float, low_flops: float = 0.0) -> float:
        """Lower bound on time: the slower of compute and memory traffic."""
        return max(self.compute_s(flops, low_flops), bytes_moved / self.bytes_per_s)


def count_flops(fn) -> int:
    """FLOPs of the matmul-like ops `fn` actually dispatches (torch's FlopCounterMode)."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()
