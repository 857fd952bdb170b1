"""The measured product forms set on a model: every module that takes them (a `forms` attribute) gets
the forms `gemm_pick` measured for its weight's shape, and the copies those forms read (oneDNN's
packed copy, the panels) are made at load, not inside the first request. A progress bar shows while
a first start on a machine times its shapes."""

from __future__ import annotations

import torch

from ..native import panels as native_panels
from . import gemm_pick
from .packs import packed_for


class MeasureBar:
    """A progress bar over the shapes `apply_to` times, shown from the first shape that is not in
    the cache (a first start on a machine times every shape: a minute or more for `small`)."""

    def __init__(self, show: bool = True):
        self.show, self.bar = show, None

    def start(self, name: str) -> None:
        if self.show and self.bar is None:
            from tqdm import tqdm
            self.bar = tqdm(desc="timing each product's forms on this machine (once)", unit=" shapes", leave=False)
        if self.bar is not None:
            self.bar.set_postfix_str(name)

    def done(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def prepack(m) -> None:
    """The copies of `m`'s weights that its chosen forms read (oneDNN's packed copy, the panels),
    made now, at load, not inside the first request."""
    if "packed" in m.forms and hasattr(m, "packed_weights"):
        packed_for(m, m.packed_weights())
    if "panels" in m.forms and getattr(m, "weight", None) is not None and gemm_pick.panels_runs(m.weight):
        native_panels.panel_weight(m.weight.detach())


def apply_to(model, progress: bool = True) -> None:
    """Set the measured forms on every module of `model` that takes them (a `forms` attribute:
    `ouro.layers.linear.Linear`, and the routed experts, which time their own forward in each form
    (`time_form(form, rows)`) and key the result by the weight `pick_weight()` names): one
    measurement per module kind and weight shape. Modules that will run the packed
    form get their packed copies now (`packed_weights()`), not inside the first request. `progress`:
    a bar while shapes not in the cache are timed."""
    bar = MeasureBar(progress)
    try:
        _apply(model, bar)
    finally:
        bar.close()


def _apply(model, bar: MeasureBar) -> None:
    chosen = {}
    for m in model.modules():
        if not hasattr(m, "forms") or getattr(m, "bias", None) is not None:
            continue
        weight = m.pick_weight() if hasattr(m, "pick_weight") else m.weight
        timer = getattr(m, "time_form", None)
        label = type(m).__name__ if timer else ""
        key = (label, tuple(weight.shape), weight.dtype, str(weight.device))
        if key not in chosen:
            chosen[key] = gemm_pick.pick_forms(weight, timer, label, bar)
        m.forms = chosen[key]
        prepack(m)
    # the projections a layer runs as one wider product (`MERGED`: `ouro.layers.merged`) are merged on
    # first use, and the merged weight's forms picked then: timed now, that pick is a cache hit there,
    # not a timing pass inside the first request's prefill
    for m in model.modules():
        for group in getattr(m, "MERGED", ()):
            parts = [getattr(m, name, None) for name in group]
            if not all(getattr(p, "forms", None) is not None and getattr(p, "bias", None) is None for p in parts):
                continue
            w = parts[0].weight
            if any(p.weight.shape[1] != w.shape[1] or p.weight.dtype != w.dtype for p in parts):
                continue
            shape = (sum(p.weight.shape[0] for p in parts), w.shape[1])
            key = ("", shape, w.dtype, str(w.device))
            if key not in chosen:
                chosen[key] = gemm_pick.pick_forms(torch.randn(shape, dtype=w.dtype, device=w.device), bar=bar)
