"""`--compile`: the decode step's chains of tiny ops compiled (torch.compile, inductor on CPU).

What the lab's redundancy probe counted (`ouro probe redundancy --model small`): 3,334 aten ops
per decode step, and the hyper-connections' Sinkhorn (20 iterations of sum / add / divide on
[T, 4, 4] matrices, twice per layer) is over half of them. Each HyperConnection's pure tensor
function (`hc_pre`: RMS-scaled projection, sigmoid / softmax gates, Sinkhorn, the pre-weighted sum)
is compiled once with dynamic row counts, so one graph serves every batch size; one token rows
are padded to two (torch specialises size 1; the padded row is zero and is dropped, it changes no
real row). The module objects, and hooks on them, stay as they are: `compile_model` wraps a built
model and `uncompile_model` undoes it. Compilation runs at start-up with a progress bar; inductor
caches its kernels on disk (`TORCHINDUCTOR_CACHE_DIR`), so a later start takes seconds."""

from __future__ import annotations

import time

import torch

from ..layers.mhc import HyperConnection, hc_pre


def _padded(fn):
    def run(streams, *args):
        T = streams.shape[0]
        if T == 1:    # one graph for every row count: size 1 would be specialised and compiled again
            streams = torch.cat([streams, torch.zeros_like(streams)])
            block_in, post, comb = fn(streams, *args)
            return block_in[:1], post[:1], comb[:1]
        return fn(streams, *args)
    return run


def compile_model(model, backend: str = "inductor", progress: bool = True) -> dict:
    """Compile the model's hyper-connection functions and warm them up; returns what was done."""
    from tqdm import tqdm
    hcs = [m for m in model.modules() if isinstance(m, HyperConnection)]
    if not hcs:
        return {"compiled": 0, "seconds": 0.0}
    compiled = torch.compile(hc_pre, dynamic=True, backend=backend)
    fn = _padded(compiled)
    start = time.perf_counter()
    p = next(model.parameters())
    first = hcs[0]
    D = first.fn.shape[1] // first.n
    # the engine's forward runs under inference_mode (no autograd keys on any tensor): warming up
    # in another mode would leave the engine's first step to compile a second graph
    with torch.inference_mode():
        for rows in tqdm((3, 1), desc="compiling the decode step (mHC)", disable=not progress):
            streams = torch.zeros(rows, first.n, D, dtype=p.dtype, device=p.device)
            fn(streams, first.fn, first.base, first.scale, first.norm_eps, first.hc_eps, first.iters)
    for m in hcs:
        m.pre_fn = fn
    return {"compiled": len(hcs), "seconds": time.perf_counter() - start, "backend": backend}


def uncompile_model(model) -> None:
    for m in model.modules():
        if isinstance(m, HyperConnection):
            m.pre_fn = None
