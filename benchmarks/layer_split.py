"""LayerSplit A/B in one run: one long prompt prefilled over `--cp` ranks in CP forwards of
`--chunk` tokens, without and with `--cp-layer-split`, launches alternating. Prints per side the
wall time (the slowest rank, median), the helper ranks' DSA cache bytes (their storage, measured)
and peak RSS; checks the engine rank's last logits are bit-identical; and reads the overlap share
of the split's latent broadcasts from the ranks' timelines (1 - time blocked waiting / broadcast
time).

    python benchmarks/layer_split.py --model small --input-len 32768 --chunk 8192 --repeats 2
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch


def rank_run(groups, model_dir, n: int, chunk: int, split: bool, seed: int):
    from ouro.machine.model_forms import apply_to
    from ouro.layers.context import ModelCache
    from ouro.measure import spans
    from ouro.models.loader import load_model
    from ouro.parallel.cp_prefill import helper_cache, run_prefill
    model = load_model(model_dir, dtype=torch.float32)
    apply_to(model)
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    rank, world = groups.cp.rank(), groups.cp.size()
    engine = rank == world - 1
    if engine:
        page = 16 * cfg.index_kpool
        cache = ModelCache(cfg, 1, -(-n // page), page)
        table = torch.arange(cache.n_pages).view(1, -1)
    else:
        cache, table = helper_cache(model, n, {}, "cpu", groups.cp, split)
    spans.clear()
    spans.enable()
    torch.distributed.barrier(group=groups.cp)
    t = time.perf_counter()
    with torch.inference_mode():
        logits, sp = run_prefill(model, cache, groups.cp, ids, 0, table, "fp32", chunk, split, full=engine)
    elapsed = time.perf_counter() - t
    spans.disable()
    events = [(e["name"], e["dur_ms"]) for e in spans.events() if e["name"].startswith("layer split")]
    return {"s": elapsed, "dsa_bytes": cache.dsa_bytes(), "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "logits": logits[-1].float() if engine else None, "events": events, "stats": sp.stats if sp else None}


def main() -> None:
    from ouro.models.resolve import resolve_model
    from ouro.parallel.groups import launch
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--input-len", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    d = str(resolve_model(a.model))
    runs = {False: [], True: []}
    for r in range(a.repeats):
        for split in (False, True):
            runs[split].append(launch(rank_run, a.cp, d, a.input_len, a.chunk, split, 0, timeout_s=3600))
            print(f"round {r + 1} split={split}: {max(x['s'] for x in runs[split][-1]):.2f} s", flush=True)
    wall = {k: statistics.median(max(x["s"] for x in ranks) for ranks in v) for k, v in runs.items()}
    helper = {k: v[0][0]["dsa_bytes"] for k, v in runs.items()}
    peak = {k: max(x["peak"] for x in v[0][:-1]) for k, v in runs.items()}
    same = all(torch.equal(p[-1]["logits"], s[-1]["logits"]) for p, s in zip(runs[False], runs[True]))
    waits = sum(ms for ranks in runs[True] for x in ranks for name, ms in x["events"] if name == "layer split wait")
    casts = sum(ms for ranks in runs[True] for x in ranks for name, ms in x["events"] if name == "layer split broadcast")
    print(f"{a.model}, {a.input_len:,} tokens, cp {a.cp}, CP forwards of {a.chunk:,} tokens, {a.repeats} rounds, medians")
    print(f"{'':28}{'cp alone':>14}{'cp + split':>14}{'split / alone':>15}")
    print(f"{'wall time (s)':28}{wall[False]:>14.2f}{wall[True]:>14.2f}{wall[True] / wall[False]:>15.3f}")
    print(f"{'helper DSA cache (MiB)':28}{helper[False] / 2**20:>14.2f}{helper[True] / 2**20:>14.2f}"
          f"{helper[True] / helper[False]:>15.3f}")
    print(f"{'helper peak RSS (MiB)':28}{peak[False] / 2**20:>14.1f}{peak[True] / 2**20:>14.1f}{peak[True] / peak[False]:>15.3f}")
    print(f"engine logits bit-identical: {same}")
    if casts:
        print(f"latent broadcasts: {casts / 1000:.3f} s from launch to the attention that reads them, "
              f"{waits / 1000:.3f} s of it blocked waiting: overlap share {1 - waits / casts:.1%} (timeline)")


if __name__ == "__main__":
    main()
