"""Bounded observations: what the agent's tools hand back to the model is never more than a
budget of characters, and always says how much there was and whether the work finished.

`cut(text, limit)` keeps the head and the tail and states the total size; `run_bounded(cmd)`
runs a command with its output going to a file (so 50 MB of output never sits in memory or in a
prompt), waits at most `timeout_s`, and returns its state (`done` or `timed-out`), exit code,
total output size and the cut observation.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass

LIMIT = 16_000      # characters an observation may take


def cut(text: str, limit: int = LIMIT, total: int | None = None) -> str:
    """`text` if it fits, else its head and tail around a line that says what was left out."""
    total = len(text) if total is None else total
    if total <= limit and len(text) <= limit:
        return text
    half = max(1, (limit - 200) // 2)
    return (text[:half] + f"\n... [output cut: {total:,} characters in all; the first {half:,} and the last {half:,} "
            "are shown] ...\n" + text[-half:])


@dataclass
class Observation:
    state: str              # "done" or "timed-out"
    exit_code: int | None
    total_bytes: int
    seconds: float
    text: str               # cut to the limit

    def render(self) -> str:
        code = "" if self.exit_code is None else f", exit {self.exit_code}"
        return f"[{self.state}{code}, {self.total_bytes:,} bytes of output, {self.seconds:.1f} s]\n{self.text}"


def run_bounded(cmd: list[str], cwd=None, timeout_s: float = 600.0, limit: int = LIMIT, env=None) -> Observation:
    with tempfile.TemporaryFile() as out:
        t = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code, state = proc.wait(timeout=timeout_s), "done"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)       # and whatever it started
            proc.wait()
            code, state = None, "timed-out"
        seconds = time.monotonic() - t
        size = out.tell()
        half = max(1, (limit - 200) // 2)
        out.seek(0)
        head = out.read(half)
        tail = b""
        if size > 2 * half:
            out.seek(size - half)
            tail = out.read(half)
        elif size > half:
            tail = out.read()
        text = (head + tail).decode(errors="replace") if size <= 2 * half else \
            cut(head.decode(errors="replace") + tail.decode(errors="replace"), limit, total=size)
    return Observation(state, code, size, seconds, text)
