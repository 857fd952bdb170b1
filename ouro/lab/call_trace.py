"""Which ouro functions ran, and the ouro call stack at chosen functions: a `sys.setprofile`
recorder for the lab (only while a probe's scenario runs; never in serving)."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # .../ouro
REPO_DIR = os.path.dirname(PACKAGE_DIR)
# the observers' own frames (the lab, and the tracer's wrappers in measure/) are not the code observed
OBSERVER_DIRS = tuple(os.path.join(PACKAGE_DIR, d) + os.sep for d in ("lab", "measure"))


def repo_path(filename: str, skip_observers: bool = True) -> str | None:
    """'ouro/engine/scheduler.py' for a file of this ouro package (the observers excluded), else None."""
    f = os.path.abspath(filename)
    if not f.startswith(PACKAGE_DIR + os.sep) or (skip_observers and f.startswith(OBSERVER_DIRS)):
        return None
    return os.path.relpath(f, REPO_DIR)


def ouro_stack(frame) -> list[tuple[str, str, int]]:
    """(file, function, first line) of the ouro frames from the outermost to `frame`."""
    out = []
    while frame is not None:
        p = repo_path(frame.f_code.co_filename)
        if p is not None:
            out.append((p, frame.f_code.co_name, frame.f_code.co_firstlineno))
        frame = frame.f_back
    return out[::-1]


class CallRecorder:
    """Records every ouro function entered (as (file, function, first line)) and, for the
    watched (file suffix, function) pairs, the ouro stack at each entry."""

    def __init__(self, watch: dict[str, tuple[str, str]] | None = None):
        self.watch = watch or {}          # label -> (file suffix, function name)
        self.called: set[tuple[str, str, int]] = set()
        self.stacks: dict[str, list[list[tuple[str, str, int]]]] = {k: [] for k in self.watch}
        self._files: dict[str, str | None] = {}

    def _profile(self, frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        p = self._files.get(code.co_filename, 0)
        if p == 0:
            p = self._files[code.co_filename] = repo_path(code.co_filename)
        if p is None:
            return
        self.called.add((p, code.co_name, code.co_firstlineno))
        for label, (suffix, fn) in self.watch.items():
            if code.co_name == fn and p.endswith(suffix):
                self.stacks[label].append(ouro_stack(frame))

    @contextmanager
    def recording(self):
        old = sys.getprofile()
        sys.setprofile(self._profile)
        try:
            yield self
        finally:
            sys.setprofile(old)
