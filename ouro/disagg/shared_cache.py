"""A decode worker's cache in shared memory, for the `shm` transfer backend.

`share(cache, tag)` moves a `ModelCache`'s tensors into files under /dev/shm, mapped shared (the
layers keep reading and writing them as before); `attach(spec)` maps the same files in another
process on this host, so a prefill worker can write a request's rows straight into the decode
worker's pages. `unlink(spec)` removes the files (the mappings stay valid until closed).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

TENSORS = ("latent", "index_keys", "index_gates", "index_pooled", "conv", "recurrent")
SHM_DIR = "/dev/shm"


def share(cache, tag: str, directory: str = SHM_DIR) -> dict:
    """Move `cache`'s tensors into shared files; returns the spec `attach` takes (JSON-able). A
    storage held per layer (a cache whose layers keep rows differently) is shared layer by layer."""
    spec = {"page_size": cache.page_size, "tensors": {}}
    for name in TENSORS:
        t = getattr(cache, name)
        if isinstance(t, list):
            parts = [_share_one(x, os.path.join(directory, f"ouro-{tag}-{name}-{i}")) for i, x in enumerate(t)]
            setattr(cache, name, [m for m, _ in parts])
            spec["tensors"][name] = [info for _, info in parts]
        else:
            mapped, spec["tensors"][name] = _share_one(t, os.path.join(directory, f"ouro-{tag}-{name}"))
            setattr(cache, name, mapped)
    return spec


def _share_one(t, path):
    mapped = torch.from_file(path, shared=True, size=t.numel(), dtype=t.dtype).view(t.shape)
    mapped.copy_(t)
    return mapped, {"path": path, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}


def attach(spec: dict) -> SimpleNamespace:
    """The shared cache as an object with `ModelCache`'s tensor attributes and page size."""
    out = SimpleNamespace(page_size=spec["page_size"])
    for name, t in spec["tensors"].items():
        setattr(out, name, [_attach_one(x) for x in t] if isinstance(t, list) else _attach_one(t))
    return out


def _attach_one(t):
    if not os.path.exists(t["path"]):
        raise FileNotFoundError(f"shared cache file {t['path']} is gone: is the decode worker on this host and running?")
    numel = 1
    for d in t["shape"]:
        numel *= d
    return torch.from_file(t["path"], shared=True, size=numel, dtype=getattr(torch, t["dtype"])).view(t["shape"])


def unlink(spec: dict) -> None:
    for t in spec["tensors"].values():
        for one in t if isinstance(t, list) else [t]:
            try:
                os.unlink(one["path"])
            except FileNotFoundError:
                pass
