"""Waiting for an `ouro serve` process started by a tool (the lab's serve scenarios, `ouro tune
--workload serve`): ready when its /health answers 200; its exit first is an error carrying the
tail of its log."""

from __future__ import annotations

import time


class ServerExited(RuntimeError):
    """The server process ended before it was ready (a refused option, a bad checkpoint)."""

    def __init__(self, returncode: int, log: str):
        super().__init__(f"ouro serve exited ({returncode}):\n{log[-2000:]}")
        self.returncode, self.log = returncode, log


def wait_ready(proc, base: str, timeout: float, log) -> None:
    """Poll `base`/health until it answers 200; `log` is the file the process writes to."""
    import httpx
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.flush()
            log.seek(0)
            raise ServerExited(proc.returncode, log.read())
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"ouro serve was not ready within {timeout:.0f} s")
