"""Prefill of one long prompt on `cp` context-parallel ranks against one rank, in the same run.

Both sides run in ranks the launcher starts (`ouro.parallel.groups.launch`: each rank gets
cores / ranks threads), alternating launch by launch; each side's time is the slowest rank's
forward, and each rank reports its peak resident memory.

Before any time is reported, the CP result is checked (last-token logits, rel. RMS <= 1e-4 in
float32, 5e-2 in bf16) against one more single-rank prefill that runs like a CP rank: chunked at
the CP cuts, with a CP rank's thread count. A different thread count alone changes the GEMMs'
rounding, and a random-weight model's indexer has near-ties that such rounding flips: on `small`
at 32K tokens one rank with 1 thread and with 2 threads differ by rel. RMS 4.0e-2, as cp 2 and cp 1
did, while chunking alone changed nothing. (`ouro probe numerics --model small --a dtype=float32
--b chunk=1000 --prompt-len 2048` shows such a flip: pool selection at position 962.) The
difference from the timed one-rank run is reported too.
"""

from __future__ import annotations

import os
import resource
import statistics
import time

import torch


def _rank_prefill(groups, model_dir, input_len: int, seed: int, precision: str, dtype, chunks: int = 1,
                  threads: int | None = None):
    from ..machine.model_forms import apply_to
    from ..layers.context import ForwardContext, ModelCache
    from ..models.loader import load_model
    from ..parallel.cp_context import slice_bounds
    from ..parallel.cp_forward import cp_forward
    if threads:
        torch.set_num_threads(threads)
    model = load_model(model_dir, dtype=dtype)
    apply_to(model)
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (input_len,), generator=torch.Generator().manual_seed(seed)).tolist()
    page = 16 * cfg.index_kpool
    pages = -(-input_len // page)
    cache = ModelCache(cfg, 1, pages, page, dtype=model.embed_tokens.weight.dtype)
    table = torch.arange(pages).view(1, -1)
    torch.distributed.barrier(group=groups.cp)
    t = time.perf_counter()
    with torch.inference_mode():
        if groups.cp_size == 1:
            bounds = slice_bounds(input_len, chunks)
            for s, e in zip(bounds, bounds[1:]):
                logits = model(torch.tensor(ids[s:e]), ForwardContext.build(cache, [e - s], [s], [0], table))
        else:
            logits, _ = cp_forward(model, cache, groups.cp, [ids], [0], [0], table, precision)
    elapsed = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024     # Linux reports KiB
    return {"s": elapsed, "peak_bytes": peak, "logits": logits[-1].float()}


def bench_prefill_cp(model_dir, input_len: int, cp: int, repeats: int = 2, precision: str = "fp32",
                     dtype=torch.float32, progress: bool = True) -> dict:
    from tqdm import tqdm

    from ..parallel.groups import launch
    times = {1: [], cp: []}
    peaks = {1: [], cp: []}
    last = {}
    for _ in tqdm(range(repeats), desc=f"prefill {input_len}: cp 1 vs cp {cp}", disable=not progress):
        for n in (1, cp):                                   # interleaved launches
            ranks = launch(_rank_prefill, n, str(model_dir), input_len, 0, precision, dtype, timeout_s=3600)
            times[n].append(max(r["s"] for r in ranks))
            peaks[n] = [max(a, r["peak_bytes"]) for a, r in zip(peaks[n] or [0] * n, ranks)]
            last[n] = ranks[-1]["logits"]
    like_a_rank = max(1, (os.cpu_count() or 1) // cp)
    ref = launch(_rank_prefill, 1, str(model_dir), input_len, 0, precision, dtype, cp, like_a_rank, timeout_s=3600)[0]
    rel = lambda a, b: float((a - b).norm() / b.norm())
    err = rel(last[cp], ref["logits"])
    tol = 1e-4 if dtype == torch.float32 else 5e-2      # bf16 rounds the two cuts differently
    if not err <= tol or last[cp].isnan().any():
        raise RuntimeError(f"cp {cp} and one rank run like a CP rank ({like_a_rank} threads, chunked at the cuts) "
                           f"disagree (rel. RMS {err:.2e}); not timing a wrong result")
    one, many = statistics.median(times[1]), statistics.median(times[cp])
    return {"input_len": input_len, "cp": cp, "repeats": repeats, "precision": precision,
            "cp1_s": one, "cp_s": many, "speedup": one / many, "rel_rms_vs_reference": err,
            "reference_threads": like_a_rank, "rel_rms_vs_cp1": rel(last[cp], last[1]),
            "cp1_peak_bytes": peaks[1], "cp_peak_bytes": peaks[cp]}


def format_prefill_cp(r: dict) -> str:
    gib = lambda b: f"{b / 2**30:.2f} GiB"
    return "\n".join([
        f"prefill of {r['input_len']} tokens, cp {r['cp']} vs cp 1, median of {r['repeats']} (interleaved launches), "
        f"chain precision {r['precision']}",
        f"  cp 1          {r['cp1_s']:.2f} s  ({r['input_len'] / r['cp1_s']:.0f} tok/s), peak memory {gib(r['cp1_peak_bytes'][0])}",
        f"  cp {r['cp']:<10} {r['cp_s']:.2f} s  ({r['input_len'] / r['cp_s']:.0f} tok/s), peak memory per rank "
        + ", ".join(gib(b) for b in r["cp_peak_bytes"]),
        f"  wall ratio    {r['speedup']:.2f}x (cp 1 time / cp {r['cp']} time)",
        f"  last-token logits: rel. RMS {r['rel_rms_vs_reference']:.1e} against one rank run like a CP rank "
        f"({r['reference_threads']} thread(s), chunked at the cuts); {r['rel_rms_vs_cp1']:.1e} against the timed cp 1",
    ])
