"""The span tracer: `with span("kv_send", cat="transfer"):` or `@span("schedule", cat="schedule")`.

Standard library only, so `engine/`, `serve/` and `bench/` can import it. Off by default: a span
then costs one flag check (plus, for the `with` form, building a small object). On, each span is
one tuple (name, cat, start_ns, dur_ns, native thread id) in a process-wide ring of at most
MAX_EVENTS (the oldest are dropped, and the trace says how many); `save(path)` writes a Chrome
trace (Perfetto opens it). Clock: `time.perf_counter_ns` (CLOCK_MONOTONIC on
Linux, shared by every process on the machine, so traces of two processes merge as they are).

`OURO_TRACE=FILE` (and `OURO_TRACE_HEARTBEAT=1`) are read here and nowhere else.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import json
import os
import threading
import time
from collections import deque

ENV_TRACE, ENV_HEARTBEAT = "OURO_TRACE", "OURO_TRACE_HEARTBEAT"


class _State:
    on = False


MAX_EVENTS = 200_000   # ~20 MB of trace JSON: a server traced for hours stays bounded

_state = _State()
_events: deque = deque(maxlen=MAX_EVENTS)   # (name, cat, start_ns, dur_ns, tid); append is atomic
_seen = [0]                                  # events recorded since clear(), dropped ones included
_thread_names: dict[int, str] = {}
_lanes: dict[str, int] = {}               # virtual lanes (e.g. async HTTP requests) -> fake tid
_clock = time.perf_counter_ns


def enable() -> None:
    _state.on = True


def disable() -> None:
    _state.on = False


def enabled() -> bool:
    return _state.on


def clear() -> None:
    _events.clear()
    _seen[0] = 0


def set_max_events(n: int) -> None:
    """Change the cap (clears the recorded events)."""
    global _events, MAX_EVENTS
    MAX_EVENTS = n
    _events = deque(maxlen=n)
    _seen[0] = 0


def dropped() -> int:
    """How many of the oldest events the cap has dropped since clear()."""
    return max(0, _seen[0] - len(_events))


def _push(ev: tuple) -> None:
    _seen[0] += 1
    _events.append(ev)


def events() -> list[dict]:
    """The recorded spans as dicts: name, cat, start_ms, dur_ms, tid, thread."""
    return [{"name": n, "cat": c, "start_ms": s / 1e6, "dur_ms": d / 1e6, "tid": t,
             "thread": _thread_names.get(t, str(t))} for n, c, s, d, t in list(_events)]


def now_ms() -> float:
    return _clock() / 1e6


def now_ns() -> int:
    return _clock()


def _tid() -> int:
    tid = threading.get_native_id()
    if tid not in _thread_names:
        _thread_names[tid] = threading.current_thread().name
    return tid


def lane(name: str) -> int:
    """A virtual lane (its own row in the trace) for work that is not one thread's, such as
    overlapping async HTTP requests on one event loop."""
    if name not in _lanes:
        _lanes[name] = -(len(_lanes) + 1)
        _thread_names[_lanes[name]] = name
    return _lanes[name]


def record(name: str, cat: str, start_ns: int, end_ns: int, tid: int | None = None) -> None:
    """Add a finished span (for spans whose start and end are not in one block)."""
    if _state.on:
        _push((name, cat, start_ns, end_ns - start_ns, _tid() if tid is None else tid))


def span(name: str, cat: str = "misc"):
    """`with span(...)` or `@span(...)`. Off, it returns a shared do-nothing object (one per
    name and category), so a `with` block costs a dict lookup and two empty calls."""
    if _state.on:
        return _Span(name, cat)
    off = _off.get((name, cat))
    if off is None:
        off = _off[(name, cat)] = _Off(name, cat)
    return off


class _Off:
    __slots__ = ("name", "cat")

    def __init__(self, name: str, cat: str):
        self.name, self.cat = name, cat

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __call__(self, fn):
        return _Span(self.name, self.cat)(fn)


_off: dict[tuple[str, str], _Off] = {}


class _Span:
    __slots__ = ("name", "cat", "t0")

    def __init__(self, name: str, cat: str = "misc"):
        self.name, self.cat, self.t0 = name, cat, 0

    def __enter__(self):
        if _state.on:
            self.t0 = _clock()
        return self

    def __exit__(self, *exc):
        if self.t0:
            _push((self.name, self.cat, self.t0, _clock() - self.t0, _tid()))
            self.t0 = 0
        return False

    def __call__(self, fn):
        name, cat = self.name, self.cat

        @functools.wraps(fn)
        def traced(*a, **k):
            if not _state.on:
                return fn(*a, **k)
            t0 = _clock()
            try:
                return fn(*a, **k)
            finally:
                _push((name, cat, t0, _clock() - t0, _tid()))
        return traced


# ---- Chrome trace ----
def chrome_events(pid: int | None = None, process_name: str | None = None) -> list[dict]:
    pid = os.getpid() if pid is None else pid
    recorded = list(_events)          # one copy: other threads may append meanwhile
    out = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
            "args": {"name": process_name or f"ouro {pid}"}},
           {"ph": "M", "name": "ouro_trace", "pid": pid, "tid": 0,   # the cap, and what it cost
            "args": {"max_events": MAX_EVENTS, "dropped_oldest_events": dropped()}}]
    tids = {e[4] for e in recorded}
    for tid in sorted(tids):
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                    "args": {"name": _thread_names.get(tid, str(tid))}})
    for n, c, s, d, t in recorded:
        out.append({"ph": "X", "name": n, "cat": c, "ts": s / 1e3, "dur": d / 1e3, "pid": pid, "tid": t})
    from . import heartbeat   # the heartbeat's samples ride along (its own module; stdlib only)
    out += heartbeat.chrome_events(pid)
    return out


def save(path: str, process_name: str | None = None) -> str:
    with open(path, "w") as fh:
        json.dump({"traceEvents": chrome_events(process_name=process_name), "displayTimeUnit": "ms"}, fh)
    return path


# ---- the environment switch: the one place OURO_TRACE is read ----
def trace_path_from_env() -> str | None:
    return os.environ.get(ENV_TRACE) or None


def start_from_env(suffix: str = "", process_name: str | None = None) -> str | None:
    """If OURO_TRACE=FILE is set: enable the tracer (and the heartbeat when
    OURO_TRACE_HEARTBEAT=1) and save FILE+suffix at exit. Returns the path it will write."""
    path = trace_path_from_env()
    if not path:
        return None
    path = path + suffix
    enable()
    if os.environ.get(ENV_HEARTBEAT) == "1":
        from . import heartbeat
        heartbeat.start()
    atexit.register(save_once, path, process_name)
    return path


_saved: set[str] = set()


def save_once(path: str, process_name: str | None = None) -> None:
    """Save (once per path: the explicit shutdown path and atexit may both ask)."""
    if path in _saved:
        return
    _saved.add(path)
    from . import heartbeat
    heartbeat.stop()
    save(path, process_name)


def set_env(path: str | None, heartbeat: bool = False) -> None:
    """Set the switch for child processes (e.g. the engine process `ouro serve` spawns)."""
    if path:
        os.environ[ENV_TRACE] = path
        if heartbeat:
            os.environ[ENV_HEARTBEAT] = "1"



class TraceToFile(argparse.Action):
    """argparse action for `--trace FILE` on commands that run the engine in-process (`ouro
    bench`): sets the switch and starts tracing at once; the trace is saved at exit."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        set_env(values)
        start_from_env()
