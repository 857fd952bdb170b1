"""Which ops may read a value on the host: the one switch between a CPU's eager fast paths and the
capturable form (a compiled graph, a CUDA graph) every op also has.

On a CPU tensor a host read (`.tolist()`, `int(t)`) waits for no device, so ops may size their
work from the data (the routed experts' per-expert counts). Where a graph is being compiled or
captured, on an accelerator, or inside `capture_path()` (the lab's redundancy probe records the
decode step that way, so its host-sync findings are the ones a capture would meet), they take
their sync-free form instead."""

from __future__ import annotations

import contextlib
import threading

import torch

_state = threading.local()


def reads_host(t: torch.Tensor) -> bool:
    """Whether reading a value of `t` on the host costs nothing here: a CPU tensor, outside a
    compiled graph and outside `capture_path()`."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling() and not getattr(_state, "capture", False)


@contextlib.contextmanager
def capture_path():
    """Ops take their capturable (host-read-free) form inside this block, on any device."""
    before = getattr(_state, "capture", False)
    _state.capture = True
    try:
        yield
    finally:
        _state.capture = before
