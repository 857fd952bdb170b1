"""Which way round a few-row product with a large weight runs faster on this machine.

`x @ W.T` (what `nn.Linear` does) and `(W @ x.T).T` compute the same products; BLAS libraries
pick different kernels for them. On one development CPU (AMD EPYC, MKL, 2 threads) the output
head's [16, 512] x [32000, 512]^T took 26 ms as `F.linear` and 15 ms the other way round (and 11
vs 6 ms at 4 rows); on another it may be the reverse. So it is measured: both forms timed at a
few decode-sized row counts, the transposed one kept for the row counts where it wins by `GAIN`,
cached per machine and shape next to the dtype choice (`$OURO_CACHE/gemm_pick.json`).
`OURO_GEMM_PICK=linear|transposed` pins it (the test suite pins `linear`, so every engine in a test
rounds alike; tests/test_gemm_pick.py checks both forms and the measurement)."""

from __future__ import annotations

import os
import time

import torch.nn.functional as F

from . import machine_cache
from .machine_cache import machine_key

FORMS = ("linear", "transposed")
GAIN = 1.15
ROWS = (1, 4, 16)


FILE = "gemm_pick.json"


def product(x, weight, form: str):
    """x @ weight.T, computed as `form` says (contiguous either way: callers may .view() it)."""
    return F.linear(x, weight) if form == "linear" else (weight @ x.T).T.contiguous()


def time_form(form: str, weight, rows: int, budget_s: float = 0.05) -> float:
    import torch
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)

    def run():
        product(x, weight, form)
    run()
    best, spent, reps = float("inf"), 0.0, 0
    while spent < budget_s and reps < 50:
        t = time.perf_counter()
        run()
        dt = time.perf_counter() - t
        best, spent, reps = min(best, dt), spent + dt, reps + 1
    return best


def choose(times: dict[str, list[float]]) -> list[str]:
    """Per measured row count: transposed where it beats linear by GAIN, else linear."""
    return ["transposed" if lin >= GAIN * tr else "linear" for lin, tr in zip(times["linear"], times["transposed"])]


def form_for(forms: list[str], rows: int) -> str:
    """The decision of the largest measured row count <= rows (the smallest below it)."""
    i = max([j for j, r in enumerate(ROWS) if r <= rows] or [0])
    return forms[i]


def pick_forms(weight) -> list[str]:
    """One form per row count in ROWS, measured once per machine and weight shape."""
    pinned = os.environ.get("OURO_GEMM_PICK")
    if pinned:
        if pinned not in FORMS:
            raise ValueError(f"OURO_GEMM_PICK must be linear or transposed, got {pinned!r}")
        return [pinned] * len(ROWS)
    key = f"{machine_key(str(weight.device))}|{tuple(weight.shape)}|{weight.dtype}"
    cache = machine_cache.read(FILE)
    hit = cache.get(key, {})
    if hit.get("rows") == list(ROWS) and len(hit.get("forms", [])) == len(ROWS) and set(hit["forms"]) <= set(FORMS):
        return hit["forms"]
    times = {f: [time_form(f, weight, r) for r in ROWS] for f in FORMS}
    cache[key] = {"forms": choose(times), "ms": {f: [round(1e3 * t, 3) for t in v] for f, v in times.items()},
                  "rows": list(ROWS)}
    machine_cache.write(FILE, cache)
    return cache[key]["forms"]
