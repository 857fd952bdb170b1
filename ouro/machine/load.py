"""Whether the rest of the machine was quiet while ouro timed something, and the rule for keeping
what was timed.

A choice timed while other processes ran (a test suite, a second server, a benchmark) describes
that moment, not the machine: on a 2-core VM a float32 one-row product timed under a parallel test
run took 0.14 ms in ouro's gemv against 0.09 in MKL, and the cached "MKL" then cost a quiet batch-1
decode step ~0.6 ms, gemv being 2x faster there. So `OtherLoad` reads, from `/proc`, the share of
the machine's CPU time that went to other processes (and to the hypervisor's steal) during the
timing. `keep` caches a choice timed while that share stayed under `busy_limit()` for good; one
timed on a busy machine is kept as provisional (`"provisional": true`): processes that find the
machine busy too use it rather than time again (inside a first step, say), and the first process
that finds it quiet (`quiet_now`, sampled once per process) times it again (`settled`). Measurements
take `one_at_a_time` (an OS lock under `$OURO_CACHE`): tensor-parallel ranks starting together
would otherwise time against each other; the second one reads what the first cached.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

from .. import machine_cache
from ..machine_cache import cache_lock, cache_root

log = logging.getLogger(__name__)

BUSY_LIMIT = 0.25      # share of all CPUs' time others may take while a choice is timed
MIN_TICKS = 20         # a window shorter than this many clock ticks over all CPUs says nothing


def busy_limit() -> float:
    """`OURO_BUSY_LIMIT` (a share, 0..1; the test suite sets 1: its own workers are the load) or BUSY_LIMIT."""
    raw = os.environ.get("OURO_BUSY_LIMIT")
    if raw is None:
        return BUSY_LIMIT
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"OURO_BUSY_LIMIT must be a share of the CPUs' time such as 0.25, got {raw!r}") from None


def _machine_ticks() -> tuple[int, int] | None:
    """(busy, total) clock ticks over all CPUs since boot: /proc/stat's first line (steal is busy)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    if len(fields) < 5:
        return None
    total = sum(fields)
    return total - fields[3] - fields[4], total          # idle and iowait are not busy


def _own_ticks() -> int | None:
    """This process's user + system ticks, all its threads."""
    try:
        with open("/proc/self/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return int(rest[11]) + int(rest[12])              # fields 14 and 15 of proc(5)
    except (OSError, ValueError, IndexError):
        return None


class OtherLoad:
    """`with OtherLoad() as load: ...`; then `load.share`: the part of all CPUs' time that other
    processes used during the block (0..1), or None where it cannot be told (no /proc, a window
    too short)."""

    share: float | None = None

    def __enter__(self):
        self._start = (_machine_ticks(), _own_ticks())
        return self

    def __exit__(self, *exc):
        (m0, o0), (m1, o1) = self._start, (_machine_ticks(), _own_ticks())
        if None in (m0, o0, m1, o1) or m1[1] - m0[1] < MIN_TICKS:
            self.share = None
        else:
            others = (m1[0] - m0[0]) - (o1 - o0)
            self.share = min(1.0, max(0.0, others / (m1[1] - m0[1])))
        return False

    @property
    def busy(self) -> bool:
        return self.share is not None and self.share > busy_limit()


@contextlib.contextmanager
def one_at_a_time(file: str):
    """Hold the lock of cache file `file` while timing: one measurement on this machine at a time."""
    with cache_lock(cache_root() / f"{file}.lock"):
        yield


QUIET_SAMPLE_S = 0.15
_quiet: list = []          # this process's one sample: [quiet?]


def quiet_now() -> bool:
    """Whether the machine is quiet enough to time on (others' share over QUIET_SAMPLE_S at or
    under the limit; True where it cannot be told), sampled once per process."""
    if not _quiet:
        with OtherLoad() as load:
            time.sleep(QUIET_SAMPLE_S)
        _quiet.append(not load.busy)
    return _quiet[0]


def settled(entry: dict) -> bool:
    """A cached entry to use as it is: timed on a quiet machine, or provisional while the machine
    is still busy."""
    return not entry.get("provisional") or not quiet_now()


_said: set = set()


def keep(file: str, key: str, entry: dict, load: OtherLoad) -> dict:
    """Cache `entry` under `key` in `file`, provisional where `load` was busy (said once per file);
    return it. The share of others is written into the entry, as evidence of a quiet measurement."""
    entry = {**entry, "other_load": None if load.share is None else round(load.share, 3)}
    if load.busy:
        entry["provisional"] = True
        if file not in _said:
            _said.add(file)
            log.warning("%s: other processes took %.0f%% of the CPUs while this was timed; the choice is kept as "
                        "provisional and timed again by the first start that finds the machine quiet (or set "
                        "OURO_BUSY_LIMIT)", file, 100 * load.share)
    cache = machine_cache.read(file)                      # read again: another process may have written
    cache[key] = entry
    machine_cache.write(file, cache)
    return entry
