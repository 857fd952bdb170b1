"""Planted faults: one file each, `FAULT = Fault(...)` naming the function it breaks, the
snippets it replaces there, where a good probe should point, and the probes a person would run
for the symptom. `all_faults()` loads them in name order."""

from __future__ import annotations

import importlib
import pkgutil

from ..fault_patch import Fault


def all_faults() -> list[Fault]:
    out = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        mod = importlib.import_module(f"{__name__}.{info.name}")
        fault = getattr(mod, "FAULT", None)
        if isinstance(fault, Fault):
            out.append(fault)
    return out
