"""A queue that wakes a loop sleeping in a poll: what a worker's threads hand its engine loop.

The transfer threads (the decode side's receiver, the prefill side's sender) report to the engine
thread through a queue. A loop that only looks at the queue now and then must wake every few
milliseconds while a transfer is in flight: the decode worker did, every 2 ms for as long as a
room waited for its prefill (500 wake-ups a second on a 2-core machine, beside the prefill's
compute). `put` here also writes a byte to a pipe, so the loop can sleep in one poll on its
messages and `fileno()` together and wake exactly when there is something to do.
"""

from __future__ import annotations

import os
import queue


class WakeQueue(queue.Queue):
    def __init__(self):
        super().__init__()
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    def put(self, item, block: bool = True, timeout: float | None = None) -> None:
        super().put(item, block, timeout)
        try:
            os.write(self._w, b"!")
        except (BlockingIOError, OSError):   # the pipe is full (a wake-up is pending anyway) or closed
            pass

    def fileno(self) -> int:
        """The pipe's read end: readable while a put has not been `drain_wakeups`'d."""
        return self._r

    def drain_wakeups(self) -> None:
        """Empty the pipe (before looking at the queue, so a later put wakes the next poll)."""
        try:
            while os.read(self._r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass
