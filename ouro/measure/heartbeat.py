"""The heartbeat: a thread that sleeps ~1 ms at a time and records how late it wakes.

A Python thread that wakes from `time.sleep` must take the GIL before it runs again, so its
lateness is the time some other thread kept the GIL (plus the OS's own scheduling delay). When a
wake is late, it samples who was running: every Python thread's frame (`sys._current_frames`)
and the CPU time each thread used since the previous wake (`/proc/self/task/<tid>/schedstat`,
nanoseconds; `stat` utime+stime in clock ticks as a fallback; nothing where neither exists), so
the timeline can say which thread held the GIL, and where, while others starved.
Standard library only."""

from __future__ import annotations

import os
import sys
import threading
import time
import types

PERIOD_S = 0.001
LATE_MS = 1.0                     # a wake this late gets a culprit sample
MAX_SAMPLES = 200_000          # ~200 s at 1 kHz
MAX_LATE = 5_000
NAME = "ouro-heartbeat"

_samples: list[tuple[float, float]] = []     # (intended wake ms, delay ms)
_late: list[dict] = []                       # culprit samples at late wakes
_thread: threading.Thread | None = None
_stop = threading.Event()
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # holds ouro/


def _cpu_ns(tid: int) -> int | None:
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"/proc/self/task/{tid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) * 10_000_000   # USER_HZ = 100
    except (OSError, ValueError, IndexError):
        return None


def own_location(frame) -> dict | None:
    """The innermost frame in this checkout's own code (not the standard library or site-packages)."""
    if not isinstance(frame, types.FrameType):
        return None
    f = frame
    # another thread's frames change under us: a stale f_back once pointed at a function (3.11)
    while isinstance(f, types.FrameType):
        path = os.path.abspath(f.f_code.co_filename)
        if path.startswith(_ROOT + os.sep) and "site-packages" not in path and not path.endswith("heartbeat.py"):
            return {"file": os.path.relpath(path, _ROOT), "function": f.f_code.co_name, "line": f.f_lineno}
        f = f.f_back
    return {"file": frame.f_code.co_filename, "function": frame.f_code.co_name, "line": frame.f_lineno}


def _sample(prev_cpu: dict, interval_ms: float, at_ms: float, delay_ms: float) -> dict:
    me = threading.get_ident()
    frames = sys._current_frames()
    threads = {t.ident: t for t in threading.enumerate()}
    per = []
    for ident, frame in frames.items():
        t = threads.get(ident)
        if ident == me or t is None:
            continue
        cpu = _cpu_ns(t.native_id) if t.native_id else None
        used = None if cpu is None or t.native_id not in prev_cpu else (cpu - prev_cpu[t.native_id]) / 1e6
        per.append({"thread": t.name, "tid": t.native_id, "cpu_ms": used, "where": own_location(frame)})
    return {"at_ms": at_ms, "delay_ms": delay_ms, "interval_ms": interval_ms, "threads": per}


def _cpu_snapshot() -> dict:
    out = {}
    for t in threading.enumerate():
        if t.native_id and t is not threading.current_thread():
            c = _cpu_ns(t.native_id)
            if c is not None:
                out[t.native_id] = c
    return out


def _loop() -> None:
    clock = time.perf_counter_ns
    prev_cpu, prev_ms = _cpu_snapshot(), clock() / 1e6
    while not _stop.is_set():
        intended = clock() / 1e6 + PERIOD_S * 1e3
        time.sleep(PERIOD_S)
        now = clock() / 1e6
        delay = now - intended
        if len(_samples) < MAX_SAMPLES:
            _samples.append((intended, delay))
        if delay >= LATE_MS and len(_late) < MAX_LATE:
            _late.append(_sample(prev_cpu, now - prev_ms, intended, delay))
        # CPU snapshot every few ms: cheap enough (a /proc read per thread) and fine enough
        if delay >= LATE_MS or len(_samples) % 4 == 0:
            prev_cpu, prev_ms = _cpu_snapshot(), clock() / 1e6


def start() -> None:
    global _thread
    if _thread is not None and _thread.is_alive():
        return
    _stop.clear()
    _thread = threading.Thread(target=_loop, name=NAME, daemon=True)
    _thread.start()


def stop() -> None:
    global _thread
    _stop.set()
    if _thread is not None:
        _thread.join(1.0)
    _thread = None


def clear() -> None:
    _samples.clear()
    _late.clear()


def samples() -> list[tuple[float, float]]:
    return list(_samples)


def late_samples() -> list[dict]:
    return list(_late)


def chrome_events(pid: int) -> list[dict]:
    """Counter track of the delay (only the notable ones, to keep traces small) and the culprit
    samples as instant events; the timeline's analysis reads them back from the trace."""
    out = [{"ph": "M", "name": "thread_name", "pid": pid, "tid": 1, "args": {"name": NAME}}] if _samples else []
    if _samples:
        out.append({"ph": "i", "name": "heartbeat_stats", "cat": "heartbeat", "ts": _samples[0][0] * 1e3,
                    "pid": pid, "tid": 1, "s": "t", "args": {"period_ms": PERIOD_S * 1e3, "samples": list(_samples)}})
    for s in _late:
        out.append({"ph": "i", "name": "heartbeat_late", "cat": "heartbeat", "ts": s["at_ms"] * 1e3, "pid": pid,
                    "tid": 1, "s": "t", "args": s})
    return out
