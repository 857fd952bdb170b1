"""The engine's tensor-parallel ranks (`--tp N`): the engine process is rank 0 and owns the
scheduler; it starts N - 1 follower processes (`python -m ouro.engine.tp_workers`), each loading
the checkpoint and keeping its shard (`parallel.tp_shard`). Every operation that touches a rank's
model or cache reaches the followers as one JSON line on their stdin, in the order rank 0 runs
it: a forward (the flat batch's ids and the arguments `ForwardContext.build` takes), a KDA
checkpoint save or restore. The forward's collectives (gloo on a CPU) then keep the ranks in
step. stdin closing (the engine exits) ends a follower.

A follower that dies makes rank 0's next collective fail (a closed connection ends it at once;
the group timeout bounds the rest): `TPWorkers.broken` says why, the engine fails what it was
running and stops (the server then reports itself unhealthy), and nothing waits on a collective
past the timeout."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys

import torch

from ..parallel.groups import free_port, init

JOIN_TIMEOUT_S = 300.0       # followers load the checkpoint before they join



def embeds_to_wire(embeds):
    """A batch's image rows for the followers (rank 0 runs the vision tower): row indices, and the
    float32 values as base64 (exact, and a third of their JSON text)."""
    if embeds is None:
        return None
    rows, values = embeds
    v = values.detach().float().contiguous().cpu()
    return {"rows": rows.tolist(), "shape": list(v.shape), "values": base64.b64encode(v.numpy().tobytes()).decode()}


def embeds_from_wire(d, device):
    if d is None:
        return None
    import numpy as np
    values = torch.from_numpy(np.frombuffer(base64.b64decode(d["values"]), dtype=np.float32).copy()).view(*d["shape"])
    return torch.tensor(d["rows"], device=device), values.to(device)

class TPBroken(RuntimeError):
    """A tensor-parallel rank is gone: the engine cannot compute any more."""


class TPWorkers:
    def __init__(self, model_dir: str, size: int, options: dict, timeout_s: float = 120.0,
                 module: str = "ouro.engine.tp_workers", cp: int = 1):
        """options: what every rank builds its model with (dtype, device, kda_chunk_size, ep,
        quantization, quantization_ignore). module: the followers' entry (`main` of a `Follower`
        class: a role with more operations names its own). cp > 1: the world is a TP x CP grid
        (`parallel.groups`); this process is TP rank 0 of the last CP index (a CP prefill's last
        slice ends here), `procs` are its TP followers, `helpers` the other CP indices' ranks,
        which take part in CP prefills only (`GridCPPrefill`)."""
        self.size, self.broken = size, None
        world, mine = size * cp, (cp - 1) * size
        port = free_port()
        threads = max(1, (os.cpu_count() or 1) // world)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        options = json.dumps(dict(options, tp=size))
        start = lambda r: subprocess.Popen([sys.executable, "-m", module, str(model_dir), str(r), str(world), str(port),
                                            str(timeout_s), options], stdin=subprocess.PIPE, env=env, text=True)
        self.procs = [start(r) for r in range(mine + 1, mine + size)]
        self.helpers = [start(r) for r in range(mine)]
        self.threads_before = torch.get_num_threads()     # the caller's, back at `close`
        torch.set_num_threads(threads)
        self.groups = init(mine, world, f"tcp://127.0.0.1:{port}", None, JOIN_TIMEOUT_S, tp=size)
        self.group = self.groups.tp

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def send(self, op: dict, helpers: bool = False) -> None:
        """One operation to every follower (`helpers`: and to the other CP indices' ranks), before
        rank 0 runs it itself."""
        if self.broken:
            raise TPBroken(f"tensor parallelism is broken: {self.broken}")
        line = json.dumps(op) + "\n"
        for h, p in enumerate(self.helpers if helpers else []):
            if p.poll() is not None:
                raise RuntimeError(f"CP rank {h // self.size} (TP rank {h % self.size}) exited (code {p.returncode})")
            p.stdin.write(line)
            p.stdin.flush()
        for r, p in enumerate(self.procs, start=1):
            if p.poll() is not None:
                self.fail(f"TP rank {r} of {self.size} exited (code {p.returncode})")
            try:
                p.stdin.write(line)
                p.stdin.flush()
            except (BrokenPipeError, OSError) as e:
                self.fail(f"TP rank {r} of {self.size} is gone ({e})")

    def diagnose(self, error: BaseException) -> str:
        """Why a forward failed on rank 0: a follower that exited (a collective notices a lost peer
        a moment before its process is reaped, so it is waited for briefly), else the error."""
        import time
        deadline = time.monotonic() + 2.0
        while True:
            dead = [(r, p.returncode) for r, p in enumerate(self.procs, start=1) if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        first_line = f"{type(error).__name__}: {error}".splitlines()[0][:200]
        if dead:
            return f"TP rank {dead[0][0]} of {self.size} exited (code {dead[0][1]}); rank 0 saw {first_line}"
        return first_line

    def fail(self, why: str, cause: BaseException | None = None):
        """Tensor parallelism is over for this engine: raises TPBroken (from `cause`)."""
        self.broken = why
        raise TPBroken(f"tensor parallelism is broken: {why}") from cause

    # ---- the rank group (`engine.ranks`): the runner and the checkpointer call these by name ----
    def forward(self, ids, ctx, candidates: int) -> None:
        """The followers run the same eager forward of the flat batch."""
        logits = ctx.logits_index.tolist() if ctx.logits_index is not None else "all"
        self.send({"op": "forward", "ids": ids.tolist(), "query_lens": list(ctx.query_lens), "start_pos": list(ctx.start_pos),
                   "slots": list(ctx.state_slots_list), "table": ctx.page_table.tolist(), "logits": logits,
                   "candidates": int(candidates), "embeds": embeds_to_wire(ctx.embeds)})

    def graph_step(self, ids, start_pos, slots, pages) -> None:
        """`--compile`: the followers run the same compiled decode step."""
        self.send({"op": "graph", "ids": list(ids), "start_pos": list(start_pos), "slots": list(slots),
                   "pages": [list(p) for p in pages]})

    def warm_up(self) -> None:
        """The followers compile their decode step, bucket by bucket, as rank 0 does."""
        self.send({"op": "warm_up"})

    def checkpoint(self, op: str, a: int, b: int) -> None:
        """A KDA checkpoint operation (`CheckpointStore`) on the followers' caches too."""
        self.send({"op": op, "a": a, "b": b})

    def build_caches(self, runner, n_checkpoints: int, kv_kinds: dict) -> None:
        """Rank 0's runner is built: the followers build the same cache, checkpoint store and
        compiled step. From then on the runner tells them each operation (the methods above)."""
        from . import decode_graph
        g = runner.graph
        graph = g and {"scratch_slot": g.scratch_slot, "scratch_page": g.scratch_page, "max_bs": g.max_bs,
                       "backend": decode_graph.BACKEND}
        self.send({"op": "cache", "n_slots": runner.cache.n_slots, "n_pages": runner.cache.n_pages,
                   "page_size": runner.cache.page_size, "n_checkpoints": n_checkpoints,
                   "kv_kinds": {str(k): v for k, v in kv_kinds.items()}, "graph": graph})

    def close(self) -> None:
        for p in self.procs + self.helpers:
            if p.poll() is None:
                try:
                    p.stdin.close()
                except OSError:
                    pass
        for p in self.procs + self.helpers:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        import torch.distributed as dist
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:       # a group broken by a lost rank
                pass
        # the process's thread count as it was: an engine closed must not leave a later one (or a
        # test) computing with a rank's share of the cores, whose products round differently
        torch.set_num_threads(self.threads_before)


def check_options(config, mc) -> None:
    """--tp / --ep against the model (splits that divide) and the options they do not combine with."""
    if config.tensor_parallel_size > 1:
        from ..parallel.tp_shard import check_split
        check_split(mc, config.tensor_parallel_size, config.expert_parallel)
        for on, what in ((config.speculative_algorithm, "speculative decoding"),
                         (config.device != "cpu", "a device other than the CPU")):
            if on:
                raise ValueError(f"tensor parallelism (--tp) does not combine with {what} yet; drop one of them")
    elif config.expert_parallel:
        raise ValueError("expert parallelism shards the routed experts over the tensor-parallel ranks: "
                         "it needs --tp N (and --ep N, the same N)")


def start(model, config, model_dir, follower_module: str | None = None):
    """Tensor parallelism: start the follower ranks and keep rank 0's shard of `model`; None at size 1.
    follower_module: the followers' entry, where a role adds operations (`Follower`)."""
    if config.tensor_parallel_size == 1:
        return None
    if model_dir is None:
        raise ValueError("tensor parallelism needs the model's checkpoint directory (model_dir): every rank loads it")
    from ..parallel.tp_shard import shard_model
    tp = TPWorkers(model_dir, config.tensor_parallel_size,
                   {"dtype": config.dtype, "device": config.device, "kda_chunk_size": config.kda_chunk_size,
                    "ep": config.expert_parallel, "quantization": config.quantization,
                    "quantization_ignore": config.quantization_ignore, "deterministic": config.deterministic_inference},
                   module=follower_module or "ouro.engine.tp_workers", cp=config.context_parallel_size)
    shard_model(model, tp.group, ep=config.expert_parallel)
    return tp


class Follower:
    """A follower rank: its shard of the model and its copy of rank 0's cache, driven by rank 0's
    operations (`run`). A role that needs more operations (a disaggregated worker's transfers)
    subclasses it and adds `op_<name>` methods; its module then runs `main` as the follower entry
    (`TPWorkers(module=...)`)."""

    def __init__(self, model_dir, rank, size, port, timeout_s, options):
        from ..config import EngineConfig
        from ..machine.model_forms import apply_to
        from ..models.loader import load_model
        from ..parallel.tp_shard import shard_model
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        o = self.options = json.loads(options)
        self.timeout_s, self.device = float(timeout_s), o["device"]
        self.dtype = EngineConfig(device=o["device"], dtype=o["dtype"]).torch_dtype()
        self.model = load_model(model_dir, dtype=self.dtype, device=self.device, kda_chunk_size=o["kda_chunk_size"])
        groups = init(int(rank), int(size), f"tcp://127.0.0.1:{port}", None, self.timeout_s, tp=o["tp"])
        # rank, size: within the TP group; mirrors: a TP follower of rank 0 (the others are CP helpers)
        self.rank, self.size, self.group, self.cp_group = groups.tp_rank, groups.tp_size, groups.tp, groups.cp
        self.mirrors = groups.cp_rank == groups.cp_size - 1
        shard_model(self.model, self.group, ep=o["ep"])
        if o.get("quantization"):
            from ..quant.w8a8 import quantize_model
            quantize_model(self.model, o["quantization"], o.get("quantization_ignore"))
        if o.get("deterministic"):
            from ..ops import batch_invariant
            batch_invariant.enable()
        apply_to(self.model)
        self.cache = self.checkpoints = self.graph = None

    def run(self, lines) -> None:
        watch_parent()
        with torch.inference_mode():
            for line in lines:
                op = json.loads(line)
                getattr(self, "op_" + op["op"])(op)
        self.close()

    def close(self) -> None:
        pass

    def op_cache(self, op):
        from ..layers.context import ModelCache
        from .checkpointer import CheckpointStore
        kinds = {int(k): v for k, v in op["kv_kinds"].items()}
        self.cache = ModelCache(self.model.config, op["n_slots"], op["n_pages"], op["page_size"], dtype=self.dtype,
                                device=self.device, kv_kinds=kinds)
        self.checkpoints = CheckpointStore(self.cache, op["n_checkpoints"]) if op["n_checkpoints"] else None
        if op.get("graph"):
            from . import decode_graph
            g = op["graph"]
            self.graph = decode_graph.DecodeGraph(self.model, self.cache, g["scratch_slot"], g["scratch_page"],
                                                  g["max_bs"], backend=g["backend"])

    def op_forward(self, op):
        from ..layers.context import ForwardContext
        logits = op["logits"]
        ctx = ForwardContext.build(self.cache, op["query_lens"], op["start_pos"], op["slots"], op["table"],
                                   logits=logits if isinstance(logits, str) else torch.tensor(logits))
        self.model.lm_head.candidates = op["candidates"]      # the same collectives as rank 0's
        ctx.embeds = embeds_from_wire(op.get("embeds"), self.device)   # rank 0 encoded the images
        self.model(torch.tensor(op["ids"], device=self.device), ctx)

    def op_warm_up(self, op):
        self.graph.warm_up(progress=False)

    def op_graph(self, op):
        self.model.lm_head.candidates = 0
        self.graph.run(op["ids"], op["start_pos"], op["slots"], op["pages"])

    def op_cp(self, op):
        """This rank's slice of a context-parallel prefill (`GridCPPrefill`): a follower of rank 0
        into its own cache (the request's pages and slot there), a CP helper into a scratch one."""
        from ..parallel.cp_prefill import helper_cache, run_prefill
        ids, cache = op["ids"], self.cache
        slot, table = op["slot"], torch.tensor([op["pages"]], dtype=torch.long)
        split = op.get("layer_split", False)
        if not self.mirrors:
            cache, table = helper_cache(self.model, len(ids), {int(k): v for k, v in op["kv_kinds"].items()},
                                        self.device, self.cp_group, split)
            slot = 0
        run_prefill(self.model, cache, self.cp_group, ids, slot, table, op["precision"], op.get("chunk", 0), split,
                    full=self.mirrors)

    def op_save(self, op):
        self.checkpoints.save_at(op["a"], op["b"])

    def op_restore(self, op):
        self.checkpoints.restore(op["a"], op["b"])


def watch_parent(period_s: float = 0.5) -> None:
    """Exit as soon as rank 0's process is gone, even while this rank waits (on a transfer, on a
    collective whose timeout is long): stdin closing only ends a rank that is reading it."""
    import threading
    import time
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(period_s)
        os._exit(1)
    threading.Thread(target=watch, name="ouro-tp-parent-watch", daemon=True).start()


def main(follower_class=Follower) -> None:
    """A follower process: `python -m MODULE model_dir rank size port timeout options`; rank 0's
    operations on stdin until it closes."""
    follower_class(*sys.argv[1:7]).run(sys.stdin)


if __name__ == "__main__":
    main()
