"""Planted faults: one file each, `FAULT = Fault(...)` naming the function it breaks, the
snippets it replaces there, where a good probe should point, and the probes a person would run
for the symptom. `all_faults()` loads them in name order. The machinery beside them (`patch.py`
applies a fault, `scoring.py` scores the probes' findings, `suite.py` is `ouro lab faults`) is not a
fault and is skipped."""

from __future__ import annotations

import importlib
import pkgutil

from .patch import Fault

MACHINERY = {"patch", "scoring", "suite"}      # modules of this package that are not planted faults


def all_faults() -> list[Fault]:
    out = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name in MACHINERY:
            continue
        mod = importlib.import_module(f"{__name__}.{info.name}")
        fault = getattr(mod, "FAULT", None)
        if isinstance(fault, Fault):
            out.append(fault)
    return out
