"""CPU time per thread of a process, from /proc: who ran, and who waited for a core, while an
interval was measured.

A wall-clock overhead is either work added to the thread being timed, or that thread waiting
(for the GIL, or for a core another runnable thread holds: on a 2-core machine one extra busy
thread is enough). Per thread, over the interval: `cpu` (seconds on a core) and `wait` (seconds
runnable but queued for a core, the kernel's schedstat) tell them apart. This process's threads
are named by their Python names, the rest (OpenMP workers, ZeroMQ's I/O threads) `native:<comm>`;
another process (a decode worker) by the same rule, its main thread `main`. Linux only: an
empty snapshot elsewhere.
"""

from __future__ import annotations

import os
import threading

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _times(pid: int, tid: str) -> tuple[str, float, float] | None:
    """(comm, cpu s, run-queue wait s) of one thread; schedstat's ns where the kernel keeps it."""
    base = f"/proc/{pid}/task/{tid}"
    try:
        with open(f"{base}/stat") as fh:
            comm, rest = fh.read().rsplit(")", 1)
    except OSError:
        return None                     # the thread ended meanwhile
    comm = comm.split("(", 1)[1]
    try:
        with open(f"{base}/schedstat") as fh:
            run_ns, wait_ns = fh.read().split()[:2]
        return comm, int(run_ns) / 1e9, int(wait_ns) / 1e9
    except (OSError, ValueError):
        f = rest.split()
        return comm, (int(f[11]) + int(f[12])) / _TICK, 0.0


def snapshot(pid: int | None = None) -> dict[str, tuple[float, float]]:
    """{thread label: (CPU seconds, run-queue wait seconds) so far} of process `pid` (default: this one)."""
    pid = pid or os.getpid()
    names = {t.native_id: t.name for t in threading.enumerate()} if pid == os.getpid() else {}
    out: dict[str, tuple[float, float]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        got = _times(pid, tid)
        if got is None:
            continue
        comm, cpu, wait = got
        label = names.get(int(tid)) or ("main" if int(tid) == pid else f"native:{comm}")
        c0, w0 = out.get(label, (0.0, 0.0))
        out[label] = (c0 + cpu, w0 + wait)
    return out


def delta(before: dict, after: dict) -> dict[str, tuple[float, float]]:
    """(CPU s, wait s) each thread spent between two snapshots; idle threads and threads that
    ended are left out."""
    out = {}
    for k, (cpu, wait) in after.items():
        c0, w0 = before.get(k, (0.0, 0.0))
        if cpu - c0 > 0 or wait - w0 > 0:
            out[k] = (cpu - c0, wait - w0)
    return out
