"""Batch-invariant kernels (`--enable-deterministic-inference`): a row's result does not depend on
how many other rows share the forward, nor where in the batch it sits.

Without this, a float32 row computed alone (a decode step) and the same row computed inside a
4-row block (a speculative verification, a bigger batch) differ in the last bits. Measured on an
AVX2 EPYC and an Intel Xeon with torch 2.13 (`tests/ops/test_batch_invariant.py` measures it again):
- BLAS picks another kernel for 1-3 rows and for the remainder of a row count that is not a
  multiple of 4 (a GEMV, an edge micro-kernel), which rounds differently; padding the rows with
  zeros to a multiple of a block (`ROW_BLOCK`, measured when enabled) makes every row go
  through the same micro-kernel;
- torch's vectorised element-wise loops compute a tensor's last `numel % 16` elements with the
  scalar formula, and for sigmoid, silu and softplus that rounds differently from the vector
  one: the flattened input is padded to a multiple of `ELEM_BLOCK`, so every element takes the
  vector path;
- reductions over a short strided axis (the Sinkhorn sums) and einsum's choice of contraction
  path change with the batch: those callers ask `enabled()` and take a fixed-order form.

The overrides replace torch's CPU kernels for `aten::mm`, `addmm`, `bmm` and the divergent
element-wise ops process-wide (`torch.library`), each calling the op's `out=` overload, which
stays torch's own. They cost time (a 1-row product runs as a 4-row one, a Python hop per op):
this is for exactness checks and reproducible serving, not the fast path; it also runs on one
thread (restored by `disable()`). `disable()` restores torch's kernels."""

from __future__ import annotations

import torch

ELEM_BLOCK = 64
ROW_BLOCKS = (4, 8, 16, 32)
PROBE_SHAPES = ((40, 24), (192, 192), (96, 512))    # (in, out): odd and even widths
# element-wise ops whose scalar tail may round differently from the vector body; each is probed
# and only those that diverge here are replaced
ELEMENTWISE = ("sigmoid", "silu", "softplus", "tanh", "exp", "gelu", "log1p", "expm1", "erf")

_state: dict = {"lib": None, "row_block": None, "elementwise": ()}


def enabled() -> bool:
    return _state["lib"] is not None


def row_block() -> int | None:
    return _state["row_block"]


def _pad_rows(x, dim: int, block: int):
    m = x.shape[dim]
    extra = (-m) % block if m else 0
    if extra == 0:
        return x, m
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_zeros(shape)], dim), m


def _products(block: int):
    def mm(a, b):
        a2, m = _pad_rows(a, 0, block)
        out = a.new_empty((a2.shape[0], b.shape[1]), dtype=torch.promote_types(a.dtype, b.dtype))
        return torch.mm(a2, b, out=out)[:m]

    def addmm(bias, a, b, *, beta=1, alpha=1):
        # the padded product, then the scaled bias added element-wise: BLAS's fused beta * C + AB
        # takes another kernel for a few rows on some CPUs (an Intel Xeon with MKL: rows 1-4 of a
        # 4-row block differed from the same rows of 48), and element-wise adds are exact per element
        prod = mm(a, b)
        if alpha != 1:
            prod = prod * alpha
        if beta == 0:
            return prod
        return prod + (bias if beta == 1 else bias * beta)

    def bmm(a, b):
        a2, m = _pad_rows(a, 1, block)
        out = a.new_empty((a.shape[0], a2.shape[1], b.shape[2]), dtype=torch.promote_types(a.dtype, b.dtype))
        return torch.bmm(a2, b, out=out)[:, :m]
    return {"mm": mm, "addmm": addmm, "bmm": bmm}


def _elementwise(name: str):
    op = getattr(torch.ops.aten, name).out

    def padded(x, *args, **kwargs):
        flat = x.reshape(-1)
        n = flat.numel()
        extra = (-n) % ELEM_BLOCK
        if extra:
            flat = torch.cat([flat, flat.new_zeros(extra)])
        out = torch.empty_like(flat)
        op(flat, *args, **kwargs, out=out)
        return out[:n].view(x.shape)
    return padded


def _tail_diverges(name: str) -> bool:
    """True when the op computes some element differently as the tail of a short tensor than
    inside a long one (scalar against vector formula), on this build and CPU."""
    op = getattr(torch.ops.aten, name).default
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * 4
    try:
        whole = op(x)
    except (RuntimeError, NotImplementedError):
        return False
    whole = whole[0] if isinstance(whole, tuple) else whole
    for n in range(1, 64):
        for start in range(0, 4096 - 64, 61):
            part = op(x[start:start + n].clone())
            part = part[0] if isinstance(part, tuple) else part
            if not torch.equal(part, whole[start:start + n]):
                return True
    return False


def rows_invariant(mm, block: int | None = None) -> bool:
    """Every row of `mm(x[:m], w)` equals the same row of `mm(x, w)` for m = 1 .. 3*block+3 and
    every probe shape: the property the overrides exist for."""
    g = torch.Generator().manual_seed(1)
    top = 3 * (block or 16) + 3
    for k, n in PROBE_SHAPES:
        x = torch.randn(top + 8, k, generator=g)
        # the weight as stored and as `F.linear` passes it (a transpose): BLAS may take another
        # small-row kernel for each (an Intel Xeon with MKL needed 8 rows for the transpose, 4 for the other)
        for w in (torch.randn(k, n, generator=g), torch.randn(n, k, generator=g).T):
            whole = mm(x, w)
            if any(not torch.equal(mm(x[:m], w), whole[:m]) for m in range(1, top)):
                return False
    return True


def _measure_row_block() -> int:
    for block in ROW_BLOCKS:
        pad = _products(block)["mm"]
        if rows_invariant(lambda a, b: pad(a, b), block):
            return block
    raise RuntimeError(f"deterministic inference: no row padding of {ROW_BLOCKS} makes this BLAS's float32 "
                       "products batch-invariant here; run without --enable-deterministic-inference")


def enable() -> int:
    """Replace the kernels (idempotent); returns the row block in use."""
    if enabled():
        return _state["row_block"]
    # one thread: with more, BLAS and oneDNN split a product's rows among threads by the row count,
    # so a row's kernel (and its rounding) changes with the batch; on an Intel Xeon no row block
    # made two threads invariant for the model's products (tests/engine/test_speculative_deterministic.py)
    _state["threads"] = torch.get_num_threads()
    torch.set_num_threads(1)
    block = _measure_row_block()
    divergent = tuple(n for n in ELEMENTWISE if hasattr(torch.ops.aten, n) and _tail_diverges(n))
    lib = torch.library.Library("aten", "IMPL")
    import warnings
    with warnings.catch_warnings():       # "overriding a previously registered kernel" is the point
        warnings.simplefilter("ignore")
        for name, fn in _products(block).items():
            lib.impl(name, fn, "CPU")
        for name in divergent:
            lib.impl(name, _elementwise(name), "CPU")
    _state.update(lib=lib, row_block=block, elementwise=divergent)
    return block


def disable() -> None:
    lib = _state["lib"]
    if lib is not None:
        lib._destroy()
        torch.set_num_threads(_state.get("threads") or torch.get_num_threads())
    _state.update(lib=None, row_block=None, elementwise=(), threads=None)


def replaced() -> tuple[str, ...]:
    """The aten ops replaced now."""
    return ("mm", "addmm", "bmm", *_state["elementwise"]) if enabled() else ()
