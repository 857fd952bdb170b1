"""Comparison helpers shared by the tests: relative RMS error (`ouro.lab.reference.compare`'s, NaN
counted as failure) and a closeness assertion on it."""

import torch

from ouro.lab.reference.compare import rel_rms  # noqa: F401  (re-exported for the tests)


def assert_close(a, b, tol=1e-5):
    assert not torch.isnan(a).any(), "NaN in the fast result"
    assert not torch.isnan(b).any(), "NaN in the reference"
    assert a.shape == b.shape
    err = rel_rms(a, b)
    assert err <= tol, f"rel RMS {err:.3e} > {tol:.0e}"
