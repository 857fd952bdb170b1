"""Which way an FP8 W8A8 product runs on this device, probed once per device.

Forms (each checked against the exact reference `fp8_linear_naive` before it is offered):
- `scaled_mm`: `torch._scaled_mm` with per-row (token) and per-column (channel) scales: the fp8
  tensor-core product on a GPU (Hopper and later); torch also runs it on a CPU. Where the device
  wants K and N in multiples of 16, the operands are zero-padded (the weight once, kept padded).
- `float`: the e4m3 values converted to float32 and multiplied by BLAS, the scales applied after:
  runs everywhere.
On a CPU both are timed once and the faster kept; elsewhere `scaled_mm` where it runs.
`OURO_FP8_FORM` pins one."""

from __future__ import annotations

import os

import torch

from ..machine.gemm_pick import best_time
from ..ops.quant import E4M3, fp8_linear_naive, quantize_rows_fp8

FORMS = ("scaled_mm", "float")
ALIGN = 16
_RUNS: dict = {}
_PICKED: dict = {}


def _pad(t, rows: int, cols: int):
    if t.shape[0] == rows and t.shape[1] == cols:
        return t
    out = torch.zeros(rows, cols, dtype=t.dtype, device=t.device)
    out[:t.shape[0], :t.shape[1]] = t
    return out


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def padded_weight(qweight):
    """qweight e4m3 [N, K] zero-padded to multiples of ALIGN (the form `scaled_mm` runs on)."""
    return _pad(qweight, _up(qweight.shape[0]), _up(qweight.shape[1]))


def fp8_mm(qx, sx, qweight, sw, form: str, padded=None):
    """e4m3 x [M, K] (row scales sx [M]) @ e4m3 w [N, K].T (channel scales sw [N]) -> float32 [M, N]."""
    M, N = qx.shape[0], qweight.shape[0]
    if form == "float":
        return (qx.float() @ qweight.float().T) * sx.unsqueeze(-1) * sw
    if form == "scaled_mm":
        w = padded if padded is not None else padded_weight(qweight)
        x = _pad(qx, max(M, ALIGN), w.shape[1])
        a = _pad(sx.float().unsqueeze(-1), x.shape[0], 1)
        b = _pad(sw.float().unsqueeze(0), 1, w.shape[0])
        out_dtype = torch.float32 if qx.device.type == "cpu" else torch.bfloat16   # CUDA's rowwise form writes bf16
        y = torch._scaled_mm(x, w.T, scale_a=a, scale_b=b, out_dtype=out_dtype)
        return y[:M, :N].float()
    raise ValueError(f"unknown fp8 form {form!r}; one of {', '.join(FORMS)}")


def form_runs(form: str, device: str = "cpu") -> str | None:
    """None where `form` runs on `device` and agrees with the exact reference; else why not."""
    key = (form, device)
    if key not in _RUNS:
        _RUNS[key] = _probe(form, device)
    return _RUNS[key]


def _probe(form: str, device: str) -> str | None:
    g = torch.Generator().manual_seed(0)
    tol = 1e-6 if form == "float" or device == "cpu" else 1e-2         # bf16 output on a GPU
    for m, k, n in ((3, 77, 24), (33, 40, 17)):
        x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
        qw, sw = quantize_rows_fp8(w)
        ref = fp8_linear_naive(x, qw, sw)
        try:
            qx, sx = quantize_rows_fp8(x.to(device))
            out = fp8_mm(qx, sx, qw.to(device), sw.to(device), form).cpu()
        except Exception as e:                     # noqa: BLE001 - any failure means "not here"
            return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        err = float((out - ref).norm() / ref.norm().clamp_min(1e-30))
        if not err <= tol:
            return f"wrong result against the exact reference (relative error {err:.2e})"
    return None


def pick_form(device: str = "cpu") -> str:
    """The form FP8 products run in on `device`."""
    pinned = os.environ.get("OURO_FP8_FORM")
    if pinned:
        if pinned not in FORMS:
            raise ValueError(f"OURO_FP8_FORM must be one of {', '.join(FORMS)}, got {pinned!r}")
        if form_runs(pinned, device) is not None:
            raise ValueError(f"OURO_FP8_FORM={pinned} does not run on {device}: {form_runs(pinned, device)}")
        return pinned
    if device not in _PICKED:
        forms = [f for f in FORMS if form_runs(f, device) is None]
        if device.startswith("cpu") and len(forms) > 1:
            g = torch.Generator().manual_seed(0)
            qw, sw = quantize_rows_fp8(torch.randn(1024, 1024, generator=g))
            qx, sx = quantize_rows_fp8(torch.randn(16, 1024, generator=g))
            pad = padded_weight(qw)
            forms.sort(key=lambda f: best_time(lambda: fp8_mm(qx, sx, qw, sw, f, pad), budget_s=0.02, max_reps=10))
        _PICKED[device] = forms[0]
    return _PICKED[device]


__all__ = ["E4M3", "FORMS", "fp8_mm", "form_runs", "padded_weight", "pick_form"]
