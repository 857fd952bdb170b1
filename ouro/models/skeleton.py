"""A model built on the meta device for its shapes alone: what `load_model` checks a checkpoint's
names, shapes and size against before it allocates anything."""

from __future__ import annotations

import contextlib

import torch


def meta_skeleton(config, kda_chunk_size: int, dtype) -> torch.nn.Module:
    """The `Glm5NextModel` of `config` on the meta device, in `dtype`, its initialisers skipped."""
    from .glm5_next import Glm5NextModel
    with torch.device("meta"), _initialisers_skipped():
        return Glm5NextModel(config, kda_chunk_size).to(dtype)


@contextlib.contextmanager
def _initialisers_skipped():
    """`torch.nn.init`'s in-place initialisers as no-ops. On the meta device they run torch's
    reference kernels, whose first call imports torch._dynamo: 1.4 s of every engine start, for values
    a meta tensor does not hold."""
    names = [n for n in dir(torch.nn.init) if n.endswith("_") and not n.startswith("_")]
    saved = {n: getattr(torch.nn.init, n) for n in names}
    try:
        for n in names:
            setattr(torch.nn.init, n, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.nn.init, n, f)
