"""Comparison helpers shared by the tests: relative RMS error, NaN counted as failure."""

import torch


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS error of a against reference b; NaN anywhere counts as infinitely wrong."""
    a, b = a.double(), b.double()
    if torch.isnan(a).any() or torch.isnan(b).any():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def assert_close(a, b, tol=1e-5):
    assert not torch.isnan(a).any(), "NaN in the fast result"
    assert not torch.isnan(b).any(), "NaN in the reference"
    assert a.shape == b.shape
    err = rel_rms(a, b)
    assert err <= tol, f"rel RMS {err:.3e} > {tol:.0e}"
