"""Which way an `x @ W.T` product runs fastest on this machine, per weight shape and row count.

The same products, five ways: `F.linear` (BLAS, MKL on x86 builds of torch), `(W @ x.T).T` (the
same BLAS, another kernel), `packed`: oneDNN's matmul on a weight reordered once into its
blocked layout (`torch.ops.mkldnn`, what inductor uses for frozen weights on a CPU), `gemv`:
ouro's native float32 kernel for a few rows (`ouro.native.gemv`, up to `GEMV_ROWS` rows: the
weight streamed once for all of them; on an AVX2 Zen 3 oneDNN's packed product read a decode
step's [512, 512] weights at 12-17 GB/s of the ~25 the memory gives), and `panels`: ouro's native
float32 kernel for a decode step's rows on a copy of the weight packed into panels of columns
(`ouro.native.panels`, up to `PANEL_ROWS` rows: every row broadcast against each weight value in
registers; on a Zen 4, 16 rows of [512, 512] with cold weights in 57 us against oneDNN's 83). On one
development CPU (AMD EPYC, MKL 2024, 2 threads) `packed` ran a [16, 512] x [512, 16384] product
at 139 GFLOP/s against F.linear's 38, and [2048, 512] x [512, 512] at 180 against 102; on another
machine the order may be the reverse. So it is measured: every form timed at a few row counts, the
fastest kept where it beats `F.linear` by `GAIN`, cached per machine and weight shape next to the
dtype choice (`$OURO_CACHE/gemm_pick.json`). `OURO_GEMM_PICK=linear|transposed|packed|gemv|panels` pins it
(the test suite pins `packed` where oneDNN is there; tests/machine/test_gemm_pick.py checks every form)."""

from __future__ import annotations

import logging
import math
import os
import time

import torch
import torch.nn.functional as F

from .. import machine_cache
from ..machine_cache import machine_key
from ..native import gemv as native_gemv
from ..native import kernels as native_kernels
from ..native import onednn as native_onednn
from ..native import panels as native_panels
from .load import OtherLoad, keep, one_at_a_time, settled
from .packs import pack, packed_for, shared_pack  # noqa: F401  (the packed form's copies: re-exported)

log = logging.getLogger(__name__)

FORMS = ("linear", "transposed", "packed", "gemv", "panels")
GAIN = 1.15
ROWS = (1, 4, 16, 64, 512)
GEMV_ROWS = native_gemv.MAX_ROWS     # the gemv form is offered (and timed) only up to this many rows
FILE = "gemm_pick.json"
FORMAT = 9          # bumped when the forms, rows or timing change: older cache entries are measured again
                    # (7: kept only when timed on a quiet machine, `load.keep`; 8: up to 512 copies; 9: panels)
ROUNDS = 2          # interleaved rounds of timing per choice
NATIVE_FORMS = {"gemv": "gemv", "packed": "onednn", "panels": "panels"}     # form -> the native family that runs it


def packable(weight) -> bool:
    """oneDNN runs this weight: a 2-D float32/bfloat16 CPU tensor, in a torch built with it, on a CPU
    whose oneDNN build takes that dtype (`form_runs`: bf16 needs AVX-512 or AVX-NE-CONVERT)."""
    return (weight.device.type == "cpu" and weight.dim() == 2 and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and form_runs("packed", weight.dtype, str(weight.device)) is None)


# the panels form up to the row counts whose nearest measured count (`form_for`) is 64: past them the
# 512-row decision holds, and there oneDNN's blocked kernels equal it (512-2048 rows: 0.95-1.05x, Zen 4)
PANEL_ROWS = math.isqrt(64 * ROWS[ROWS.index(64) + 1])     # 181: r follows 64's decision while r * r <= 64 * 512


def native_runs(form: str, weight) -> bool:
    """ouro's native float32 form (`gemv`, `panels`) runs this weight: a 2-D float32 CPU tensor, with
    its family built here (not turned off by `OURO_FUSED=0`) and agreeing with a float64 product
    (`form_runs`)."""
    return (weight.device.type == "cpu" and weight.dim() == 2 and weight.dtype == torch.float32
            and native_kernels.load(NATIVE_FORMS[form]) and form_runs(form, weight.dtype, str(weight.device)) is None)


def gemv_runs(weight) -> bool:
    return native_runs("gemv", weight)


def panels_runs(weight) -> bool:
    return native_runs("panels", weight)


MOST_ROWS = {"gemv": GEMV_ROWS, "panels": PANEL_ROWS}     # forms offered only up to a row count


def offers(form: str, rows: int) -> bool:
    """Whether `form` takes part at `rows` rows (gemv: only up to GEMV_ROWS, panels up to PANEL_ROWS;
    every other form: always)."""
    return rows <= MOST_ROWS.get(form, rows)


# (form, dtype, device) -> None where the form runs here and agrees with a float64 product, else why not
_RUNS: dict = {}
PROBE_SHAPE = (3, 40, 24)        # rows, in, out: odd sizes, so a kernel's tail handling runs too
PADDED_PROBE_ROWS = 18           # more rows for the packed form's probe: 21 in all, padded to row_bucket's 22
PANELS_PROBE_SHAPE = (21, 136, 72)  # the panels form's: past one tile's rows (8), a chunk's terms (64), a panel's columns (32)


def form_runs(form: str, dtype, device: str = "cpu") -> str | None:
    """None when `form` computes a small product in `dtype` on `device` on this machine and agrees
    with a float64 product; otherwise the reason (the kernel's error, or its error against the
    reference). Every form is checked this way before `available_forms` offers it: a torch build
    can have a kernel that this CPU cannot run (oneDNN's bf16 reorder raises on an AVX2-only CPU),
    and no choice is made on what a form's name promises. Checked once per process."""
    key = (form, dtype, device)
    if key not in _RUNS:
        _RUNS[key] = _probe(form, dtype, device)
        if _RUNS[key] is not None:
            # said once: with bf16 on an AVX2-only CPU the products fall back to F.linear (slow, emulated)
            log.warning("gemm_pick: the %s form is not offered for %s on this machine (%s); --dtype auto "
                        "measures which dtype runs fast here", form, dtype, _RUNS[key])
    return _RUNS[key]


def _probe(form: str, dtype, device: str) -> str | None:
    rows, k, n = PANELS_PROBE_SHAPE if form == "panels" else PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen).to(device=device, dtype=dtype)
    x = torch.randn(rows, k, generator=gen).to(device=device, dtype=dtype)
    if form == "packed":        # past oneDNN's exact row counts too: the padded rows' path is checked as well
        x = torch.cat([x, torch.randn(PADDED_PROBE_ROWS, k, generator=gen).to(device=device, dtype=dtype)])
    try:
        with torch.no_grad():
            # the packed form as layers run it: native's op where it is built (a wrong one is refused here)
            out = product(x, w, form)
    except Exception as e:                         # noqa: BLE001 - any failure means "not here"
        cpu = torch.backends.cpu.get_cpu_capability() if device == "cpu" else device
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} (CPU capability {cpu})"
    ref = x.double() @ w.double().T
    err = ((out.double() - ref).norm() / ref.norm()).item()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    if not (out.shape == ref.shape and err < tol):     # NaN fails too
        return f"wrong result: relative error {err:.3g} against float64 (limit {tol:g})"
    return None


EXACT_ROWS = 16


def row_bucket(rows: int) -> int:
    """The row count a packed product runs at: exact up to EXACT_ROWS, beyond rounded up to one of
    8 steps per power of two (at most 12.5% padding). oneDNN builds a kernel per new row count, and
    that cost 1-1.5 ms a time at 300-1600 rows against 0.9-4.7 ms for the product itself;
    per-expert and chunked-prefill row counts vary from step to step."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << max(0, rows.bit_length() - 4)
    return -(-rows // step) * step


def product(x, weight, form: str, packed=None):
    """x [M, K] @ weight.T, computed as `form` says (contiguous either way: callers may .view() it).
    `packed`: `pack(weight)` for the packed form (rows padded to `row_bucket`); without it, native's
    `packed_linear` (the same product, the op keeping the packed copy) where it is built, else a copy
    packed for this call; gemv and panels beyond the rows they are offered at (`offers`) run F.linear."""
    if form in MOST_ROWS and not offers(form, x.shape[0]):
        return F.linear(x, weight)
    if form == "gemv":
        return native_gemv.gemv(x, weight)
    if form == "panels":
        return native_panels.panel_linear(x, weight)
    if form == "packed":
        if packed is None and native_onednn.can(x, weight):     # the op keeps the packed copy (`shared_pack`)
            return native_onednn.packed_linear(x, weight)
        packed = pack(weight) if packed is None else packed
        rows = x.shape[0]
        padded = row_bucket(rows)
        if padded != rows:
            x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
            return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")[:rows]
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return F.linear(x, weight) if form == "linear" else (weight @ x.T).T.contiguous()


# timed over distinct copies of the weight adding up to this many bytes: more than a CPU's last-level
# cache, as in a real step (a model's weights stream from memory). With one hot copy, F.linear's
# one-row product read a 1 MB weight from cache in 24 us against packed's 103 us; over 64 copies it
# took 128 us against 80. Small weights need many copies: with 64, a [136, 512] weight's copies (18 MB)
# stayed in a Zen 4's L3, where F.linear's one thread read them in 10 us against gemv's 7; over 512
# copies, as cold as in a step, 29 us against 15 (and the compiled batch-1 step ran 2.6% faster).
STREAM_BYTES = 64 << 20
MAX_COPIES = 512


# Past a few rows a product is bound by its arithmetic, not by where its weight is read from: there a
# pass reads at most this many copies (512 for every row count made a first start's picks of `small`
# take 94 s against 60 s with 64)
COMPUTE_BOUND_COPIES = 64


def stream_copies(weight, rows: int = 1) -> int:
    """How many distinct copies of `weight` a timing pass of `rows` rows reads: STREAM_BYTES' worth,
    1 to MAX_COPIES (to COMPUTE_BOUND_COPIES past EXACT_ROWS rows)."""
    most = MAX_COPIES if rows <= EXACT_ROWS else COMPUTE_BOUND_COPIES
    return max(1, min(most, STREAM_BYTES // max(1, weight.numel() * weight.element_size())))


def time_form(form: str, weight, rows: int, budget_s: float = 0.05, copies: int | None = None) -> float:
    """Seconds per product: the best over repeats of one pass over `copies` distinct weights."""
    copies = stream_copies(weight, rows) if copies is None else copies
    weights = [weight.detach().clone() for _ in range(copies)]
    packs = [pack(w) for w in weights] if form == "packed" else [None] * copies
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)

    def run():
        for w, p in zip(weights, packs):
            product(x, w, form, p)
    return best_time(run, budget_s) / copies


def best_time(run, budget_s: float = 0.05, min_reps: int = 3, max_reps: int = 50) -> float:
    """Seconds of `run()`: the best over at least `min_reps` calls and about `budget_s`, after a warm-up."""
    run()
    best, spent, reps = float("inf"), 0.0, 0
    while (spent < budget_s or reps < min_reps) and reps < max_reps:
        t = time.perf_counter()
        run()
        dt = time.perf_counter() - t
        best, spent, reps = min(best, dt), spent + dt, reps + 1
    return best


def choose(times: dict[str, list[float]]) -> list[str]:
    """Per measured row count: the fastest form where it beats linear by GAIN, else linear."""
    out = []
    for i, lin in enumerate(times["linear"]):
        best = min((f for f in times if f != "linear"), key=lambda f: times[f][i], default=None)
        out.append(best if best is not None and lin >= GAIN * times[best][i] else "linear")
    return out


def form_for(forms: list[str], rows: int, grid: tuple = ROWS) -> str:
    """The decision of the measured row count (of `grid`) nearest to `rows` in log scale (ties to
    the smaller): 256 rows follow 512's decision, not 64's (the fp32 experts' prefill ran the
    per-expert packed loop 1.5x faster at 256 rows than the path chosen at 64)."""
    return forms[_nearest(max(rows, 1), grid)]


def _nearest(rows, grid: tuple) -> int:
    # |log r - log g[j]| <= |log g[j+1] - log r| exactly when r * r <= g[j] * g[j+1]: integer
    # comparisons, so a compiled graph's symbolic row count takes them as guards, not as a constant
    j = 0
    while j + 1 < len(grid) and rows * rows > grid[j] * grid[j + 1]:
        j += 1
    return j


def available_forms(weight) -> tuple[str, ...]:
    """The forms offered for `weight`: `linear` (the fallback), and every other form that runs and
    agrees with a reference here (`form_runs`; `packed` needs oneDNN too, `gemv` and `panels` a
    float32 CPU weight and ouro's native build)."""
    special = {"packed": packable, "gemv": gemv_runs, "panels": panels_runs}
    return tuple(f for f in FORMS if f == "linear" or (special[f](weight) if f in special else
                                                        form_runs(f, weight.dtype, str(weight.device)) is None))


def pick_forms(weight, timer=None, label: str = "", bar=None) -> list[str]:
    """One form per row count in ROWS, measured once per machine and weight shape. `timer(form,
    rows)`: seconds of a whole module's forward in that form, for modules whose choice is more
    than one product (`label` keeps their cache entries apart); default: `time_form`. `bar`: a
    `model_forms.MeasureBar` told of each shape timed."""
    pinned = os.environ.get("OURO_GEMM_PICK")
    forms = available_forms(weight) if timer is None else tuple(f for f in ("linear", "packed")
                                                               if f in available_forms(weight))
    if pinned:
        if pinned not in FORMS:
            raise ValueError(f"OURO_GEMM_PICK must be one of {', '.join(FORMS)}, got {pinned!r}")
        return [pinned if pinned in forms and offers(pinned, r) else "linear" for r in ROWS]
    # keyed by the native forms' builds too: a pick timed on another build of gemv or the packed op
    # is timed again (the stale picks of an older, slower gemv kept F.linear for [320, 512] at one
    # row, 62 us against the new gemv's 17; the compiled batch-1 step ran 6.6% slower for it)
    builds = ",".join(f"{family} {native_kernels.build_id(family)}" for form, family in NATIVE_FORMS.items()
                      if form in forms)
    key = f"{machine_key(str(weight.device))}|{label}{tuple(weight.shape)}|{weight.dtype}|{builds}"
    with one_at_a_time(FILE):
        hit = machine_cache.read(FILE).get(key, {})
        if hit.get("format") == FORMAT and hit.get("rows") == list(ROWS) and len(hit.get("forms", [])) == len(ROWS) \
                and set(hit["forms"]) <= set(forms) and settled(hit):
            return hit["forms"]
        if bar is not None:
            bar.start(f"{label}{tuple(weight.shape)} {str(weight.dtype).removeprefix('torch.')}")
        timer = timer or (lambda f, r: time_form(f, weight, r))
        # rounds of every form at every row count, interleaved, best kept: a burst of load on a shared
        # machine then slows one round of all forms, not one form (measured all of one form first, the
        # fp32 experts kept `linear` at 64 rows where the packed loop ran 1.3x faster); a form not
        # offered at a row count (`offers`) is not timed there and cannot win it
        times = {f: [float("inf")] * len(ROWS) for f in forms}
        with OtherLoad() as others:
            for _ in range(ROUNDS):
                for i, r in enumerate(ROWS):
                    for f in forms:
                        if offers(f, r):
                            times[f][i] = min(times[f][i], timer(f, r))
        entry = {"forms": choose(times),
                 "ms": {f: [None if math.isinf(t) else round(1e3 * t, 3) for t in v] for f, v in times.items()},
                 "rows": list(ROWS), "format": FORMAT}
        kept = keep(FILE, key, entry, others)["forms"]
        if bar is not None:
            bar.done()
        return kept
