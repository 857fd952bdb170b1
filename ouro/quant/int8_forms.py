"""Which way an int8 x int8 -> int32 product runs on this machine, measured once and cached.

Forms, each exact (checked against `int8_mm_naive` before it is offered):
- `native`: ouro's kernel (`int8_native`: 16-bit products on AVX2, vpdpbusd with VNNI), built for this CPU;
- `int_mm`: `torch._int_mm` (fast where torch has a real kernel: VNNI CPUs, GPUs; a slow fallback
  on an AVX2-only CPU, 0.5 GOP/s measured; on CUDA the operands are zero-padded to its shapes);
- `chunked`: float32 BLAS on K-chunks that stay exact (`int8_mm_chunked`): runs everywhere.
The fastest form at a few row counts on one representative product is kept per machine in
`$OURO_CACHE/int8_pick.json`; `OURO_INT8_FORM` pins one (tests check every form). The routed experts
pick apart (`kind="experts"`, timed on a whole experts layer): where `native` is their form they run
as one fused call, otherwise as a product per expert, so one product's speed does not decide it."""

from __future__ import annotations

import logging
import os

import torch

from .. import machine_cache
from ..machine.gemm_pick import best_time
from ..machine.load import OtherLoad, keep, one_at_a_time, settled
from ..machine_cache import machine_key
from ..ops.quant import int8_mm_chunked, int8_mm_naive
from . import int8_native
from .int8_native import native

log = logging.getLogger(__name__)

FORMS = ("native", "int_mm", "chunked")
# row counts each form is timed at: decode (1, 16), small chunks (128) and a prefill chunk (1024), which
# took 128 rows' choice before. The forms' order can change between them (Zen 5, the [1024, 1024]
# layer: native ahead at 1 and 16 rows, `_int_mm` at 128 and 1024 by 10-15%, the two within 3% over
# a whole 16 x 512 prefill of `small`, one process, alternating)
ROWS = (1, 16, 128, 1024)
SHAPE = (1024, 1024)           # N, K of the product each form is timed on
FILE = "int8_pick.json"
FORMAT = 4          # 3: kept only when timed on a quiet machine (`machine.load.keep`); 4: a prefill row count
_RUNS: dict = {}


def int8_mm(x, w, form: str):
    """x int8 [M, K] @ w int8 [N, K].T -> int32 [M, N], computed as `form` says."""
    if form == "native":
        return native().int8_mm(x, w)
    if form == "int_mm":
        if x.device.type != "cpu":          # CUDA's kernel wants M > 16 and K, N in multiples of 8
            M, N = x.shape[0], w.shape[0]
            k8, n8 = -(-x.shape[1] // 8) * 8, -(-N // 8) * 8
            xp = x.new_zeros(max(M, 17), k8)
            xp[:M, :x.shape[1]] = x
            wp = w.new_zeros(n8, k8)
            wp[:N, :w.shape[1]] = w
            return torch._int_mm(xp, wp.T)[:M, :N]
        return torch._int_mm(x, w.T)
    if form == "chunked":
        return int8_mm_chunked(x, w)
    raise ValueError(f"unknown int8 form {form!r}; one of {', '.join(FORMS)}")


def form_runs(form: str, device: str = "cpu") -> str | None:
    """None where `form` runs here and equals the exact reference on odd-sized products; else why not."""
    key = (form, device)
    if key not in _RUNS:
        _RUNS[key] = _probe(form, device)
        if _RUNS[key] is not None and form != "native":     # native says why itself
            log.info("int8 form %s is not offered here: %s", form, _RUNS[key])
    return _RUNS[key]


def _probe(form: str, device: str) -> str | None:
    if form == "native" and (device != "cpu" or native() is None):
        return "ouro's int8 kernel is not built here"
    g = torch.Generator().manual_seed(0)
    for m, k, n in ((3, 77, 24), (33, 40, 17)):      # a tail in every loop of the kernel
        x = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8).to(device)
        w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8).to(device)
        try:
            out = int8_mm(x, w, form)
        except Exception as e:                     # noqa: BLE001 - any failure means "not here"
            return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if not torch.equal(out.cpu(), int8_mm_naive(x.cpu(), w.cpu())):
            return "wrong result against the exact reference"
    return None


def available_forms(device: str = "cpu") -> tuple[str, ...]:
    return tuple(f for f in FORMS if form_runs(f, device) is None)


def pick_forms(device: str = "cpu", timer=None, kind: str = "product") -> list[str]:
    """One form per row count in ROWS: the fastest measured here (cached per machine and `kind`).
    `timer(form, rows)`: seconds of the whole work a caller runs in that form (the W8A8 layers time
    theirs, weights prepared as they run them; the experts a whole layer at `rows` rows an expert);
    default: the int32 product alone."""
    forms = available_forms(device)
    pinned = os.environ.get("OURO_INT8_FORM")
    if pinned:
        if pinned not in FORMS:
            raise ValueError(f"OURO_INT8_FORM must be one of {', '.join(FORMS)}, got {pinned!r}")
        if pinned not in forms:
            raise ValueError(f"OURO_INT8_FORM={pinned} does not run on this machine: {form_runs(pinned, device)}")
        return [pinned] * len(ROWS)
    key = (f"{machine_key(device)}|{','.join(forms)}" + (f"|kernel {int8_native.build_id()}" if "native" in forms else "")
           + ("" if kind == "product" else f"|{kind}"))
    with one_at_a_time(FILE):
        hit = machine_cache.read(FILE).get(key, {})
        if hit.get("format") == FORMAT and hit.get("rows") == list(ROWS) and set(hit.get("forms", ())) <= set(forms) \
                and settled(hit):
            return hit["forms"]
        n, k = SHAPE
        if timer is None:
            w = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device)
            xs = {r: torch.randint(-127, 128, (r, k), dtype=torch.int8, device=device) for r in ROWS}
            timer = lambda f, r: best_time(lambda: int8_mm(xs[r], w, f), budget_s=0.02, max_reps=10)   # noqa: E731
        with OtherLoad() as others:
            times = {f: [timer(f, r) for r in ROWS] for f in forms}
        chosen = [min(forms, key=lambda f: times[f][i]) for i in range(len(ROWS))]
        entry = {"forms": chosen, "ms": {f: [round(1e3 * t, 4) for t in v] for f, v in times.items()},
                 "rows": list(ROWS), "format": FORMAT}
        return keep(FILE, key, entry, others)["forms"]

