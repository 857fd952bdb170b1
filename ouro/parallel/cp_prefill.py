"""Context-parallel prefill for the engine: `ouro serve --cp N`.

The engine process is the last rank of an N-rank CP group; it starts N - 1 helper ranks as
processes (`python -m ouro.parallel.cp_prefill`, each loading the same checkpoint). A long
prompt's prefill runs on all of them (`cp_forward`): the helpers take the first slices, the
engine the last, so it ends with the whole prompt's DSA cache (all-gathered) and the request's
KDA state in its own pages and slot, and decodes on its own. A job reaches the helpers as one
JSON line on their stdin (stdin closing, e.g. when the engine dies, stops them); the
computation's exchange is torch.distributed (gloo on a CPU).

If a rank fails or dies mid-prefill, the collective fails on the engine (a closed connection
ends it at once; the group's timeout bounds the rest), that request fails with the error, the
helpers are stopped, and the engine serves on without CP. When tracing is on, each helper's
spans of the job come back to the engine's timeline on a lane per rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist

from ..measure import spans
from ..measure.spans import span
from .cp_forward import cp_forward
from .groups import free_port, init
from .layer_split import LayerSplit, chunk_bounds, owned, share_state

JOIN_TIMEOUT_S = 300.0      # helpers load the checkpoint before they join the group


class CPPrefillError(RuntimeError):
    """A CP prefill that could not finish; the request fails with this message."""


class CPPrefill:
    def __init__(self, model_dir: str, model, world: int, precision: str, dtype: str, device: str = "cpu",
                 kda_chunk_size: int = 16, timeout_s: float = 120.0, quantization: str | None = None,
                 quantization_ignore=None, kv_kinds: dict | None = None, chunk: int = 0, layer_split: bool = False):
        """`quantization`, `quantization_ignore`, `kv_kinds`: what the engine's own model and cache
        run with; every helper rank builds the same, so all ranks compute one model. `chunk`:
        tokens per CP forward (0: the whole prompt in one); `layer_split`: LayerSplit."""
        self.model, self.world, self.precision = model, world, precision
        self.chunk, self.layer_split = chunk, layer_split
        self.split_stats: dict = {}
        self.broken: str | None = None       # why CP is off after a failure
        self.num_prefills = 0
        port = free_port()
        threads = max(1, (os.cpu_count() or 1) // world)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        self.helpers = [subprocess.Popen(
            [sys.executable, "-m", "ouro.parallel.cp_prefill", str(model_dir), str(r), str(world), str(port), dtype,
             device, str(kda_chunk_size), str(timeout_s),
             json.dumps({"quantization": quantization, "quantization_ignore": quantization_ignore,
                         "kv_kinds": kv_kinds or {}})], stdin=subprocess.PIPE, env=env, text=True)
            for r in range(world - 1)]
        self.groups = init(world - 1, world, f"tcp://127.0.0.1:{port}", None, JOIN_TIMEOUT_S)
        self.timeout_s = timeout_s

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.helpers]

    def prefill(self, cache, ids: list[int], slot: int, pages: list[int]) -> torch.Tensor:
        """The request's whole prompt `ids` into `cache` (its `pages`, state `slot`); the last
        token's logits [1, V]."""
        if self.broken:
            raise CPPrefillError(f"context parallelism is off: {self.broken}")
        try:
            self._send_job(ids, slot, pages)
            with span("cp prefill", cat="compute"):
                logits, split = run_prefill(self.model, cache, self.groups.cp, ids, slot,
                                            torch.tensor([pages], dtype=torch.long), self.precision, self.chunk,
                                            self.layer_split, full=True)
            if split is not None:
                self.split_stats = split.stats
            if spans.enabled():
                self._collect_spans()
            self.num_prefills += 1
            return logits
        except Exception as e:
            self.broken = f"{type(e).__name__}: {e}"
            self.close()
            if isinstance(e, CPPrefillError):
                raise
            raise CPPrefillError(f"the context-parallel prefill failed ({self.broken}); CP is now off") from e

    def _send_job(self, ids, slot, pages) -> None:
        dead = [r for r, p in enumerate(self.helpers) if p.poll() is not None]
        if dead:
            raise CPPrefillError(f"CP rank {dead[0]} of {self.world} exited (code {self.helpers[dead[0]].returncode})")
        job = json.dumps({"ids": ids, "trace": spans.enabled(), "precision": self.precision, "chunk": self.chunk,
                          "layer_split": self.layer_split})
        for p in self.helpers:
            p.stdin.write(job + "\n")
            p.stdin.flush()

    def _collect_spans(self) -> None:
        got = [None] * self.world
        dist.all_gather_object(got, [], group=self.groups.cp)
        for r, events in enumerate(got[:-1]):
            lane = spans.lane(f"cp rank {r}")
            for name, cat, start, end in events:
                spans.record(name, cat, start, end, tid=lane)

    def close(self) -> None:
        for p in self.helpers:
            if p.poll() is None:
                try:
                    p.stdin.close()
                except OSError:
                    pass
        for p in self.helpers:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if dist.is_initialized():       # this process's world ends with its helpers (a new CPPrefill makes another)
            try:
                dist.destroy_process_group()
            except Exception:            # a group broken by a lost rank: nothing left to tear down
                pass


class GridCPPrefill(CPPrefill):
    """`--cp` with `--tp`: the CP ranks are a TP x CP grid's (`groups.init(tp=N)`), started by the
    engine's tensor-parallel workers (`ranks`: `engine.tp_workers.TPWorkers`, passed in, not
    imported). Each CP index is a TP group holding its shards; CP index c's rank t computes slice
    c of the prompt with its TP group's collectives and exchanges with CP group t (the KDA state
    of its own heads, the DSA rows). The engine's TP followers end with the request's state in
    their own caches, as the engine does. A failure turns CP off (TP goes on: its groups do not
    include the CP helpers). The helpers' spans are not collected."""

    def __init__(self, ranks, model, precision: str, kv_kinds: dict | None = None, chunk: int = 0,
                 layer_split: bool = False):
        self.ranks, self.model, self.precision = ranks, model, precision
        self.chunk, self.layer_split, self.split_stats = chunk, layer_split, {}
        self.groups, self.world = ranks.groups, ranks.groups.cp_size
        self.kv_kinds = {str(k): v for k, v in (kv_kinds or {}).items()}
        self.broken: str | None = None
        self.num_prefills = 0
        self.helpers = []        # the processes are the TP workers': they close them

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.ranks.helpers]

    def _send_job(self, ids, slot, pages) -> None:
        self.ranks.send({"op": "cp", "ids": ids, "slot": slot, "pages": list(pages), "precision": self.precision,
                         "kv_kinds": self.kv_kinds, "chunk": self.chunk, "layer_split": self.layer_split}, helpers=True)

    def _collect_spans(self) -> None:
        pass

    def close(self) -> None:
        pass


def start(model, config, model_dir, ranks=None, kv_kinds: dict | None = None):
    """`--cp N` for an engine: None at N = 1; over the TP workers' grid with `--tp` (`ranks`);
    else N - 1 helper processes of its own."""
    if config.context_parallel_size == 1:
        return None
    if config.cp_layer_split and any(v is not None for v in (kv_kinds or {}).values()):
        raise ValueError("--cp-layer-split keeps DSA rows in the model dtype: drop --kv-cache-dtype")
    if ranks is not None:
        return GridCPPrefill(ranks, model, config.chain_precision(), kv_kinds, config.cp_chunk_size,
                             config.cp_layer_split)
    if model_dir is None:
        raise ValueError("context_parallel_size > 1 needs the model's checkpoint directory (model_dir): "
                         "every rank loads it")
    return CPPrefill(model_dir, model, config.context_parallel_size, config.chain_precision(), config.dtype,
                     config.device, config.kda_chunk_size, quantization=config.quantization,
                     quantization_ignore=config.quantization_ignore, kv_kinds=kv_kinds, chunk=config.cp_chunk_size,
                     layer_split=config.cp_layer_split)


def scratch_cache(model, n_tokens: int, kv_kinds: dict, device, keep_dsa=None):
    """A helper rank's cache for one prompt's slice exchange: one state slot, pages for `n_tokens`
    (whole pools per page); `keep_dsa`: LayerSplit's owned DSA layers (the rest share a scratch
    layer). Returns (cache, its page table [1, pages])."""
    from ..layers.context import ModelCache
    page = 16 * model.config.index_kpool
    pages = -(-n_tokens // page)
    cache = ModelCache(model.config, 1, pages, page, dtype=model.embed_tokens.weight.dtype, device=device,
                       kv_kinds=kv_kinds, keep_dsa=keep_dsa)
    return cache, torch.arange(pages).view(1, -1)


def helper_cache(model, n_tokens: int, kv_kinds: dict, device, group, layer_split: bool):
    """`scratch_cache` for this CP rank: with LayerSplit, its own DSA layers only."""
    keep = None
    if layer_split:
        keep = owned(len(model.config.dsa_layers), dist.get_world_size(group), dist.get_rank(group))
    return scratch_cache(model, n_tokens, kv_kinds, device, keep)


def run_prefill(model, cache, group, ids: list[int], slot: int, table, precision: str, chunk: int = 0,
                layer_split: bool = False, full: bool = False):
    """One prompt's CP prefill on this rank, in forwards of `chunk` tokens (0: one forward); after
    each but the last, the last rank's KDA state goes to every rank. Returns (this rank's logits
    of the last forward, its `LayerSplit` or None); `full`: this rank keeps every layer (the engine)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    split = LayerSplit(model.config, group, rank, world, full) if layer_split else None
    logits = None
    for s, e in chunk_bounds(len(ids), chunk, world):
        logits, _ = cp_forward(model, cache, group, [ids[s:e]], [s], [slot], table, precision, split=split)
        if e < len(ids):
            share_state(cache, slot, group, world - 1)
    return logits, split


def _helper_main(model_dir, rank, world, port, dtype, device, kda_chunk_size, timeout_s, options="{}") -> None:
    from ..config import EngineConfig
    from ..machine.model_forms import apply_to
    from ..models.loader import load_model
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model = load_model(model_dir, dtype=EngineConfig(device=device, dtype=dtype).torch_dtype(), device=device,
                       kda_chunk_size=int(kda_chunk_size))
    options = json.loads(options)
    if options.get("quantization"):
        from ..quant.w8a8 import quantize_model
        quantize_model(model, options["quantization"], options.get("quantization_ignore"))
    kv_kinds = {int(k): v for k, v in options.get("kv_kinds", {}).items()}
    apply_to(model)
    groups = init(int(rank), int(world), f"tcp://127.0.0.1:{port}", None, float(timeout_s))
    for line in sys.stdin:                     # one job per line; EOF: the engine is done with us
        job = json.loads(line)
        ids = job["ids"]
        cache, table = helper_cache(model, len(ids), kv_kinds, device, groups.cp, job.get("layer_split", False))
        if job["trace"]:
            spans.clear()
            spans.enable()
        with torch.inference_mode(), span("cp prefill", cat="compute"):
            run_prefill(model, cache, groups.cp, ids, 0, table, job["precision"], job.get("chunk", 0),
                        job.get("layer_split", False))
        if job["trace"]:
            spans.disable()
            events = [(e["name"], e["cat"], int(e["start_ms"] * 1e6), int((e["start_ms"] + e["dur_ms"]) * 1e6))
                      for e in spans.events()]
            dist.all_gather_object([None] * int(world), events, group=groups.cp)
        del cache


if __name__ == "__main__":
    _helper_main(*sys.argv[1:])
