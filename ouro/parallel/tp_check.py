"""Run a checkpoint tensor-parallel for a few steps and return what rank 0 saw: the check behind
the TP tests, `ouro probe numerics --b tp=2` and the TP benchmark. `run_steps` is the per-rank
function `groups.launch` starts: each rank loads the checkpoint, keeps its shard, and runs one
batched prefill of the prompts then `decode_steps` greedy decode steps on its own cache."""

from __future__ import annotations

import time

import torch

from .tp_shard import shard_model


def _memory(model) -> int:
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def run_steps(groups, model_dir: str, prompts: list[list[int]], decode_steps: int, ep: bool = False,
              dtype=torch.float32, page_size: int = 16, taps: list[str] | None = None, threads: int | None = None,
              quantization: str | None = None):
    """-> dict(logits [steps+1, B, V] float32, tokens [B, steps], weight_bytes, cache_bytes,
    seconds {prefill, decode}, taps {module name: gathered output of the prefill}) on rank 0."""
    from ..layers.context import ForwardContext, ModelCache
    from ..models.loader import load_model
    if threads:
        torch.set_num_threads(threads)
    group = groups.cp if groups.world_size > 1 else None
    model = load_model(model_dir, dtype=dtype)
    if group is not None:
        shard_model(model, group, ep=ep)
    if quantization:                   # after the split, as the engine does
        from ..quant.w8a8 import quantize_model
        quantize_model(model, quantization)
    B = len(prompts)
    pages_per = -(-(max(map(len, prompts)) + decode_steps + 1) // page_size)
    cache = ModelCache(model.config, B, B * pages_per, page_size, dtype=dtype)
    table = [list(range(b * pages_per, (b + 1) * pages_per)) for b in range(B)]
    recorded = {}
    hooks = [model.get_submodule(name).register_forward_hook(
        lambda mod, inp, out, name=name: recorded.setdefault(name, out[0] if isinstance(out, tuple) else out))
        for name in (taps or [])]
    from .tp_layers import COLLECTIVE_SECONDS
    logits, tokens, seconds = [], [], {}
    with torch.inference_mode():
        model(torch.tensor(prompts[0][:2]), ForwardContext.build(cache, [2], [0], [0], table[:1]))   # warm-up
        for k in COLLECTIVE_SECONDS:
            COLLECTIVE_SECONDS[k] = 0.0
        t0 = time.perf_counter()
        ctx = ForwardContext.build(cache, [len(p) for p in prompts], [0] * B, list(range(B)), table)
        logits.append(model(torch.tensor([t for p in prompts for t in p]), ctx).float())
        seconds["prefill"] = time.perf_counter() - t0
        seconds["prefill_collectives"] = sum(COLLECTIVE_SECONDS.values())
        for h in hooks:
            h.remove()
        pos = [len(p) for p in prompts]
        t0 = time.perf_counter()
        for _ in range(decode_steps):
            nxt = logits[-1].argmax(-1)
            tokens.append(nxt)
            ctx = ForwardContext.build(cache, [1] * B, pos, list(range(B)), table)
            logits.append(model(nxt, ctx).float())
            pos = [p + 1 for p in pos]
        seconds["decode"] = time.perf_counter() - t0
        seconds["decode_collectives"] = sum(COLLECTIVE_SECONDS.values()) - seconds["prefill_collectives"]
    cache_bytes = sum(t.numel() * t.element_size() for t in (cache.conv, cache.recurrent))
    if groups.rank != 0:
        return None
    return {"logits": torch.stack(logits), "tokens": torch.stack(tokens, 1) if tokens else None,
            "weight_bytes": _memory(model), "state_bytes": cache_bytes, "seconds": seconds,
            "taps": {k: v.float() for k, v in recorded.items()}}


def run(model_dir: str, prompts, decode_steps: int, tp: int = 1, ep: bool = False, dtype=torch.float32,
        page_size: int = 16, taps: list[str] | None = None, threads: int | None = None,
        quantization: str | None = None) -> dict:
    """run_steps on `tp` new processes (tp = 1: one process too, so every run pays the same
    start-up); rank 0's result."""
    from .groups import launch
    return launch(run_steps, tp, str(model_dir), prompts, decode_steps, ep, dtype, page_size, taps, threads,
                  quantization)[0]


def lm_head_check(groups, weight, x, ks=(1, 3), compiled: bool = False):
    """The vocabulary-parallel output layer built from a full `weight` [V, D] on this rank: rank
    0 returns (gathered logits, {k: candidate logits}) for rows `x` [T, D]; `compiled`: and what a
    compiled graph of the head and the embedding returns ({"compiled": {k: (logits, embedded)}, ...})."""
    from torch import nn
    from .tp_shard import _shard_vocab
    V, D = weight.shape
    holder = nn.Module()
    holder.config = type("C", (), {"vocab_size": V})()
    holder.embed_tokens = nn.Embedding(V, D)
    holder.lm_head = nn.Linear(D, V, bias=False)
    holder.lm_head.weight.data.copy_(weight)
    holder.embed_tokens.weight.data.copy_(weight)        # the same rows on every rank
    _shard_vocab(holder, groups.rank, groups.world_size, groups.cp)
    with torch.inference_mode():
        out = holder.lm_head(x), {k: holder.lm_head.candidate_logits(x, k) for k in ks}
        if compiled:    # the collectives as opaque ops in one traced graph (`--compile --tp`)
            step = torch.compile(lambda x, ids: (holder.lm_head(x), holder.embed_tokens(ids)), backend="aot_eager",
                                 fullgraph=True)
            ids = torch.arange(V - 1, -1, -max(1, V // 7))
            got = {}
            for k in (0,) + tuple(ks):
                holder.lm_head.candidates = k
                got[k] = step(x, ids)
            out = out + ({"compiled": got, "embedding": holder.embed_tokens(ids)},)
    return out if groups.rank == 0 else None
