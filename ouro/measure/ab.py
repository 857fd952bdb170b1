"""A/B verdicts: the one helper every speed comparison uses. Runs alternate (A B B A ...) so
drift hits both sides alike, each pair gets a fresh input so no cache can fake a result, and the
verdict says faster / slower / no difference beyond the noise (a bootstrap interval of the ratio
of medians)."""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable


@dataclass
class Verdict:
    label_a: str
    label_b: str
    median_a_s: float
    median_b_s: float
    ratio: float            # median B / median A: < 1 means B is faster
    low: float              # bootstrap interval of the ratio
    high: float
    noise: float            # relative spread (median absolute deviation / median), the larger side
    repeats: int
    verdict: str            # "faster", "slower" or "no difference": B against A

    def to_dict(self) -> dict:
        return asdict(self)

    def text(self) -> str:
        return (f"{self.label_b} vs {self.label_a}: {self.verdict} (time ratio {self.ratio:.3f}, "
                f"interval {self.low:.3f}..{self.high:.3f}, noise {self.noise:.1%}, {self.repeats} pairs; "
                f"medians {self.median_a_s * 1e3:.2f} ms vs {self.median_b_s * 1e3:.2f} ms)")


def _mad(xs: list[float]) -> float:
    m = statistics.median(xs)
    return statistics.median(abs(x - m) for x in xs) / m if m > 0 else 0.0


def verdict_from_times(times_a: list[float], times_b: list[float], label_a: str = "A", label_b: str = "B",
                       min_effect: float = 0.02, resamples: int = 2000, seed: int = 0, paired: bool = False) -> Verdict:
    """Verdict from measured times. B is called faster only when the whole 95% interval of the
    ratio of medians lies below 1 - min_effect (slower: above 1 + min_effect). `paired`: times_a[i]
    and times_b[i] were measured side by side (one round), so rounds are resampled whole and a
    slow stretch of the machine, which slows both sides of its rounds, does not widen the interval."""
    if not times_a or not times_b:
        raise ValueError("an A/B verdict needs at least one time on each side")
    if paired and len(times_a) != len(times_b):
        raise ValueError(f"a paired verdict needs as many times on each side, got {len(times_a)} and {len(times_b)}")
    ma, mb = statistics.median(times_a), statistics.median(times_b)
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        if paired:
            idx = rng.choices(range(len(times_a)), k=len(times_a))
            ra = statistics.median(times_a[i] for i in idx)
            rb = statistics.median(times_b[i] for i in idx)
        else:
            ra = statistics.median(rng.choices(times_a, k=len(times_a)))
            rb = statistics.median(rng.choices(times_b, k=len(times_b)))
        ratios.append(rb / ra if ra > 0 else float("inf"))
    ratios.sort()
    low, high = ratios[int(0.025 * resamples)], ratios[int(0.975 * resamples) - 1]
    if high < 1 - min_effect:
        v = "faster"
    elif low > 1 + min_effect:
        v = "slower"
    else:
        v = "no difference"
    return Verdict(label_a, label_b, ma, mb, mb / ma if ma > 0 else float("inf"), low, high,
                   max(_mad(times_a), _mad(times_b)), min(len(times_a), len(times_b)), v)


def ab_compare(run_a: Callable[[Any], Any], run_b: Callable[[Any], Any], make_input: Callable[[int], Any] | None = None,
               repeats: int = 7, warmup: int = 1, label_a: str = "A", label_b: str = "B",
               min_effect: float = 0.02, timer: Callable[[], float] = time.perf_counter) -> Verdict:
    """Time `run_a(x)` and `run_b(x)` on the same fresh input `x = make_input(i)` per pair, the
    order alternating between pairs. Warm-up pairs are run and thrown away."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    make_input = make_input or (lambda i: None)
    times = {"a": [], "b": []}
    for i in range(warmup + repeats):
        x = make_input(i)
        order = (("a", run_a), ("b", run_b)) if i % 2 == 0 else (("b", run_b), ("a", run_a))
        for side, fn in order:
            t0 = timer()
            fn(x)
            dt = timer() - t0
            if i >= warmup:
                times[side].append(dt)
    return verdict_from_times(times["a"], times["b"], label_a, label_b, min_effect)
