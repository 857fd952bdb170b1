"""The rooms a request walks through: every ouro function entered while one request is served,
recorded with `sys.setprofile` (the second request of its kind: the first builds and warms).

    python benchmarks/request_walk.py                          # this tree
    python benchmarks/request_walk.py --tree /tmp/old          # another tree (a git worktree), same walk

Two walks: an offline `LLM.generate` of one prompt, and one chat completion served by `ouro serve`
(`python -m ouro.cli serve` run on a thread of this process, so the frontend's calls are seen; its engine
process runs the engine's step, which the offline walk shows). A room is a package of `ouro`
(`engine`, `serve`, ...; a top-level module is its own room); the observers (`measure`, `lab`)
are left out. Printed per walk: the files entered, by room, and the calls back into a room the
call stack had already left (A -> B -> A: B calling back into A), each as caller -> callee.
"""

from __future__ import annotations

import argparse
import dis
import io
import os
import sys
import threading

OBSERVERS = ("measure", "lab")


def tree_arg() -> str:
    """The tree whose `ouro` is walked (`--tree`, else this one): read before anything imports ouro."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--tree", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    return os.path.abspath(ap.parse_known_args()[0].tree)


TREE = tree_arg()
sys.path.insert(0, TREE)
PACKAGE = os.path.join(TREE, "ouro")
from ouro.bench.server_process import wait_ready  # noqa: E402  (the tree's own)


def room_of(filename: str) -> tuple[str, str] | None:
    """('engine', 'engine/scheduler.py') for a file of the imported ouro package, else None."""
    f = os.path.abspath(filename)
    if not f.startswith(PACKAGE + os.sep):
        return None
    rel = os.path.relpath(f, PACKAGE)
    room = rel.split(os.sep)[0].removesuffix(".py")
    return None if room in OBSERVERS else (room, rel)


class Walk:
    def __init__(self):
        self.on = False
        self.files: set[str] = set()
        self.functions: dict[str, set[str]] = {}
        self.callbacks: set[str] = set()
        self._rooms: dict[str, tuple[str, str] | None] = {}
        self._starts: dict = {}              # coroutine / generator code -> the offset its first run starts at

    def _where(self, code):
        got = self._rooms.get(code.co_filename, 0)
        if got == 0:
            got = self._rooms[code.co_filename] = room_of(code.co_filename)
        return got

    def profile(self, frame, event, arg):
        if not self.on or event != "call":
            return
        here = self._where(frame.f_code)
        if here is None or self._resumed(frame):
            return
        self.files.add(here[1])
        self.functions.setdefault(here[1], set()).add(frame.f_code.co_name)
        stack, f = [], frame.f_back          # the rooms below this call, innermost first, runs collapsed
        while f is not None:
            w = self._where(f.f_code)
            if w is not None and (not stack or stack[-1][0] != w[0]):
                stack.append((w[0], f"{w[1]}:{f.f_code.co_name}"))
            f = f.f_back
        if stack and stack[0][0] != here[0] and any(r == here[0] for r, _ in stack[1:]):
            self.callbacks.add(f"{stack[0][1]} -> {here[1]}:{frame.f_code.co_name}")

    def _resumed(self, frame) -> bool:
        """A coroutine or generator resumed (a 'call' event too): the event loop's own ticks (the
        server's main task, the engine client's reader) are not the request entering a room."""
        code = frame.f_code
        if not code.co_flags & (0x20 | 0x80 | 0x200):       # generator, coroutine, async generator
            return False
        start = self._starts.get(code)
        if start is None:
            start = self._starts[code] = next(i.offset for i in dis.get_instructions(code) if i.opname == "RESUME")
        return frame.f_lasti != start

    def report(self, title: str, functions: bool = False) -> str:
        by_room: dict[str, list[str]] = {}
        for f in sorted(self.files):
            by_room.setdefault(f.split(os.sep)[0].removesuffix(".py"), []).append(f)
        lines = [f"{title}: {len(self.files)} files in {len(by_room)} rooms; "
                 f"{len(self.callbacks)} calls back into a room already left"]
        lines += [f"  {room:10s} {len(fs):3d}  {', '.join(os.path.basename(x) for x in fs)}" for room, fs in sorted(by_room.items())]
        lines += [f"  back: {c}" for c in sorted(self.callbacks)]
        if functions:
            lines += [f"    {f}: {', '.join(sorted(self.functions[f]))}" for f in sorted(self.files)]
        return "\n".join(lines)


def offline_walk(model: str) -> Walk:
    from ouro import LLM, SamplingParams
    llm = LLM(model, dtype="float32", max_memory=64 << 20, page_size=16)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate("def main(", params)
    w = Walk()
    sys.setprofile(w.profile)
    w.on = True
    try:
        llm.generate("def main(", params)
    finally:
        w.on = False
        sys.setprofile(None)
    return w


class _Alive:
    """The server's thread as `wait_ready` watches a process: `poll()` is None while it runs."""

    def __init__(self, thread):
        self.thread = thread

    def poll(self):
        return None if self.thread.is_alive() else 1


def served_walk(model: str, port: int) -> Walk:
    import runpy

    import httpx
    # `python -m ouro.cli serve ...`, run as the user runs it, on a thread of this process
    sys.argv = ["ouro", "serve", "--model", model, "--port", str(port), "--dtype", "float32", "--max-memory", str(64 << 20)]
    w = Walk()
    threading.setprofile(w.profile)
    t = threading.Thread(target=runpy.run_module, args=("ouro.cli",), kwargs={"run_name": "__main__"}, daemon=True)
    t.start()
    threading.setprofile(None)
    base = f"http://127.0.0.1:{port}"
    wait_ready(_Alive(t), base, 300, io.StringIO())
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    httpx.post(base + "/v1/chat/completions", json=body, timeout=120).raise_for_status()
    w.on = True
    try:
        httpx.post(base + "/v1/chat/completions", json=body, timeout=120).raise_for_status()
    finally:
        w.on = False
    return w


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-py")
    ap.add_argument("--port", type=int, default=18431)
    ap.add_argument("--tree", default=None, help="the checkout whose ouro is walked (default: this one)")
    ap.add_argument("--functions", action="store_true", help="also list the functions entered in each file")
    a = ap.parse_args()
    print(f"ouro at {PACKAGE}")
    print(offline_walk(a.model).report("offline LLM.generate", a.functions))
    print(served_walk(a.model, a.port).report("served chat completion (the frontend)", a.functions))
    os._exit(0)      # the server thread and its engine process go with this process


if __name__ == "__main__":
    main()
