"""The host allocator's thresholds, set once per engine process (glibc on Linux).

glibc's malloc hands every block above its mmap threshold (128 KB at first, raised dynamically up to
32 MB) straight back to the kernel when it is freed. A prefill step allocates and frees activations
of several MB many times a step, so each new one faults its pages in again: on the Xeon VM a fresh
16 MB buffer took 3.7 ms to fill against 0.87 ms for a reused one, and torch's row quantisation of
a 8,192 x 512 input 15.3 against 5.7 ms. Keeping blocks below MMAP_THRESHOLD in the heap (and up to
TRIM_THRESHOLD of free memory at its top) reuses them: a W8A8 16 x 512 prefill of `small` ran
3,413 -> 3,000 ms (two pairs alternating with OURO_MALLOC_TUNE=0; float32's did not move). What stays mmap'd: the weights, the KV cache and state
pools (hundreds of MB and more), still untouched until used. vLLM's CPU backend asks for TCMalloc
through LD_PRELOAD for the same reason; this needs no extra library. `OURO_MALLOC_TUNE=0`, or the
MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ variables (glibc's own), leave the allocator alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

from ..machine_cache import switched_off

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3      # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 256 << 20       # blocks below this come from the heap and are reused
TRIM_THRESHOLD = 1 << 30         # free memory kept at the heap's top before it is given back
_STATE: dict = {}


def why_not() -> str | None:
    """None where the thresholds can be set here; else why they are left alone."""
    if not sys.platform.startswith("linux"):
        return f"not glibc ({sys.platform})"
    if switched_off("OURO_MALLOC_TUNE"):
        return "OURO_MALLOC_TUNE=0"
    user = [v for v in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_") if v in os.environ]
    if user:
        return f"{', '.join(user)} set: glibc takes the user's thresholds"
    return None


def keep_activation_buffers() -> bool:
    """Set the thresholds (once a process); True when they are set."""
    if "set" not in _STATE:
        why = why_not()
        ok = False
        if why is None:
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                ok = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and \
                    bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
                why = None if ok else "mallopt refused the thresholds"
            except (OSError, AttributeError) as e:    # no libc by that name, or one without mallopt (musl)
                why = f"no mallopt here ({e})"
        if why is not None:
            log.debug("host allocator left as it is: %s", why)
        _STATE["set"] = ok
    return _STATE["set"]
