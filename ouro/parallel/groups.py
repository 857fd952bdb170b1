"""The one place ouro's ranks and their process groups are made.

`launch(fn, world_size)` starts `world_size` processes (torch.multiprocessing spawn), joins them
into one torch.distributed world over TCP on 127.0.0.1 (gloo on a CPU, NCCL where every rank has
a GPU), builds the named groups and calls `fn(groups, *args)` on each rank. It returns every rank's
result in rank order. If a rank fails, the error is raised here with its rank and traceback, and
no rank waits on a collective past `timeout_s`. Under `torchrun`, `from_env()` joins the world
torchrun made instead.
"""

from __future__ import annotations

import datetime
import io
import os
import socket
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Groups:
    """This rank's place: the world, its context-parallel group (ranks in token order) and its
    tensor-parallel group. Without TP the CP group is the world; with TP (`init(tp=N)`) the world
    is a grid, rank = c * N + t: TP group c holds ranks c*N .. c*N + N-1, CP group t holds ranks
    t, N + t, 2N + t, ... (so pure TP is one TP group, the world, and CP groups of one rank)."""
    rank: int
    world_size: int
    cp: object            # a torch.distributed ProcessGroup
    cp_rank: int
    cp_size: int
    backend: str
    tp: object = None     # the tensor-parallel group (None without TP)
    tp_rank: int = 0
    tp_size: int = 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(rank: int, world_size: int, init_method: str, backend: str | None = None, timeout_s: float = 120.0,
         tp: int = 1) -> Groups:
    """Join the world; `tp` > 1 lays it out as a TP x CP grid (`Groups`). Every rank makes every
    group, in the same order (torch.distributed asks it)."""
    backend = backend or ("nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo")
    if world_size % tp:
        raise ValueError(f"a world of {world_size} ranks is not a grid of tensor-parallel groups of {tp}")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    if tp == 1:
        cp = dist.new_group(list(range(world_size)))
        return Groups(rank, world_size, cp, dist.get_rank(cp), dist.get_world_size(cp), backend)
    n_cp = world_size // tp
    tps = [dist.new_group([c * tp + t for t in range(tp)]) for c in range(n_cp)]
    cps = [dist.new_group([c * tp + t for c in range(n_cp)]) for t in range(tp)]
    c, t = divmod(rank, tp)
    return Groups(rank, world_size, cps[t], c, n_cp, backend, tps[c], t, tp)


def from_env(backend: str | None = None, timeout_s: float = 120.0) -> Groups:
    """Join a world made by torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment)."""
    return init(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", backend, timeout_s)


def _rank_main(rank, world_size, port, backend, timeout_s, fn, args, results):
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        groups = init(rank, world_size, f"tcp://127.0.0.1:{port}", backend, timeout_s)
        out = fn(groups, *args)
        buf = io.BytesIO()      # bytes, not shared-memory tensors: those vanish when this process exits
        torch.save(out, buf)
        results.put((rank, "ok", buf.getvalue()))
    except BaseException as e:                          # reported to the launcher, with where it happened
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(fn, world_size: int, *args, backend: str | None = None, timeout_s: float = 120.0) -> list:
    """fn(groups, *args) on `world_size` new processes; their results in rank order. `fn` and its
    results must be picklable (a module-level function; tensors are fine)."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, backend, timeout_s, fn, args, results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    got, errors = {}, {}
    grace_until = None          # after a first failure, a moment to hear the other ranks: the cause
    while len(got) + len(errors) < world_size:      # (a dead peer) often shows up just after its effect
        if grace_until is not None and time.monotonic() > grace_until:
            break
        if not results.empty():
            rank, status, out = results.get()
            if status == "error":
                errors[rank] = f"failed: {out}"
            else:
                got[rank] = torch.load(io.BytesIO(out), weights_only=False)
        else:
            for r, p in enumerate(procs):
                if r not in got and r not in errors and p.exitcode not in (None, 0) and results.empty():
                    errors[r] = f"died (exit code {p.exitcode}) without a result"
            time.sleep(0.02)
        if errors and grace_until is None:
            grace_until = time.monotonic() + 1.0
    for p in procs:
        if errors and p.is_alive():
            p.kill()               # no rank is left waiting on a collective its peer will never join
        p.join(timeout=timeout_s)
    if errors:
        raise RuntimeError("; ".join(f"rank {r} of {world_size} {m}" for r, m in sorted(errors.items())))
    return [got[r] for r in range(world_size)]
