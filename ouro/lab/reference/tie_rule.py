"""One defined tie rule for transformers' DSA indexer: among pools with equal scores, the earlier
pool wins (the rule ouro documents in ouro/ops/dsa/indexer.py).

With random weights many pools score exactly 0 (ReLU(q.k) is 0 for every indexer head), and
`torch.topk` breaks such ties in an unspecified, shape-dependent order, so the reference's
selection would be arbitrary. `install()` wraps `Glm5NextTextIndexer.forward` so that, while it
runs, every `topk` it calls is a stable descending sort (lowest index first among equals). The
MoE router's `topk` runs outside the indexer and is untouched.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys

import torch
from torch.overrides import TorchFunctionMode

_TOPK = {torch.topk, torch.Tensor.topk}


def stable_topk(x, k, dim=-1, largest=True, sorted=True):
    """`torch.topk` with ties broken towards the lower index (values and indices sorted)."""
    values, indices = torch.sort(x, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


class StableTopk(TorchFunctionMode):
    """Inside this mode `torch.topk` / `Tensor.topk` resolve ties by index (earlier wins)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _TOPK:
            return stable_topk(*args, **kwargs)
        return func(*args, **kwargs)


MODULE = "transformers.models.glm5_next.modeling_glm5_next"


class _InstallOnImport(importlib.abc.MetaPathFinder):
    """Installs the rule the moment transformers' glm5_next modeling module is first imported, so
    registering it costs nothing in a session that never runs transformers."""

    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _wrap(module)
        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Make the rule active for every later use of transformers' glm5_next model (idempotent)."""
    if MODULE in sys.modules:
        _wrap(sys.modules[MODULE])
    elif not any(isinstance(f, _InstallOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _InstallOnImport())


def _wrap(m) -> None:
    cls = m.Glm5NextTextIndexer
    if getattr(cls.forward, "_ouro_stable_topk", False):
        return
    original = cls.forward

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        with StableTopk():
            return original(self, *args, **kwargs)
    forward._ouro_stable_topk = True
    forward._ouro_original = original
    cls.forward = forward


def installed() -> bool:
    from transformers.models.glm5_next import modeling_glm5_next as m
    return bool(getattr(m.Glm5NextTextIndexer.forward, "_ouro_stable_topk", False))
