"""Each op's share of a real model step: the kernels probe wraps the module globals through which
the layers call the ops (e.g. `ouro.layers.context.kda_chunk`), runs one prefill step and one decode
step of the model, and sums the time spent inside each op. With share s, a k-times faster kernel
makes the step 1 / (1 - s + s / k) times faster (Amdahl)."""

from __future__ import annotations

import importlib
import time
from contextlib import contextmanager

import torch

from ...layers.context import ForwardContext, ModelCache


def amdahl(share: float, k: float) -> float:
    """Step speed-up when a part holding `share` of the time gets k times faster (k may be inf)."""
    return 1.0 / (1.0 - share + (share / k if k != float("inf") else 0.0))


@contextmanager
def timed_globals(targets: dict[str, tuple[str, str]], totals: dict[str, list]):
    """Replace each (module, name) with a wrapper adding its wall time and call count to totals[op]."""
    saved = []
    try:
        for op, (mod_name, attr) in targets.items():
            mod = importlib.import_module(mod_name)
            orig = getattr(mod, attr)
            totals.setdefault(op, [0.0, 0])

            def wrapper(*a, _orig=orig, _acc=totals[op], **kw):
                t0 = time.perf_counter()
                try:
                    return _orig(*a, **kw)
                finally:
                    _acc[0] += time.perf_counter() - t0
                    _acc[1] += 1
            setattr(mod, attr, wrapper)
            saved.append((mod, attr, orig))
        yield totals
    finally:
        for mod, attr, orig in reversed(saved):
            setattr(mod, attr, orig)


def _steps(model, prefill_len: int, decode_batch: int, seed: int):
    """(prefill step, decode step) callables over one cache: a prompt of `prefill_len` tokens, then
    one new token for each of `decode_batch` sequences that all read that prompt's pages (each writes
    its new token into a page of its own), so the decode batch sees a real context without
    prefilling every sequence."""
    cfg = model.config
    page = 4 * cfg.index_kpool
    pages = -(-(prefill_len + 1) // page)
    dev = model.embed_tokens.weight.device
    cache = ModelCache(cfg, decode_batch, pages + decode_batch, page, dtype=model.embed_tokens.weight.dtype, device=dev)
    table = torch.arange(pages).view(1, -1)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (prefill_len,), generator=gen).to(dev)
    dec_table = table.repeat(decode_batch, 1)
    dec_table[:, prefill_len // page] = pages + torch.arange(decode_batch)   # private page for the new token
    dec_ids = torch.randint(0, cfg.vocab_size, (decode_batch,), generator=gen).to(dev)

    def prefill():
        model(ids, ForwardContext.build(cache, [prefill_len], [0], [0], table))

    def decode():
        model(dec_ids, ForwardContext.build(cache, [1] * decode_batch, [prefill_len] * decode_batch,
                                            list(range(decode_batch)), dec_table))
    return prefill, decode


def step_shares(model, targets: dict[str, tuple[str, str]], prefill_len: int, decode_batch: int,
                repeats: int = 1, seed: int = 0) -> dict:
    """{"prefill"|"decode": {"step_s": median step time, "ops": {op: {"s": time per step, "calls": n,
    "share": fraction of the step}}}}; one warm-up step each, then `repeats` timed steps."""
    prefill, decode = _steps(model, prefill_len, decode_batch, seed)
    out = {}
    with torch.no_grad():
        for phase, fn in (("prefill", prefill), ("decode", decode)):
            fn()
            totals: dict[str, list] = {}
            step_total = 0.0
            n = repeats if phase == "prefill" else 5 * repeats   # decode steps are cheap: more of them
            with timed_globals(targets, totals):
                for _ in range(n):
                    t0 = time.perf_counter()
                    fn()
                    step_total += time.perf_counter() - t0
            out[phase] = {"step_s": step_total / n, "rows": prefill_len if phase == "prefill" else decode_batch,
                          "ops": {op: {"s": s / n, "calls": c // n, "share": s / step_total if step_total else 0.0}
                                  for op, (s, c) in totals.items() if c}}
    return out
