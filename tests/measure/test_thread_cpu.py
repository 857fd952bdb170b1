"""Per-thread CPU and run-queue wait from /proc: a busy thread is charged its time under its
Python name, an idle one nothing, and two busy threads beside a third on this machine's cores
show as waiting."""

import hashlib
import os
import threading
import time

import pytest

from ouro.measure import thread_cpu

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="per-thread times come from Linux /proc")


def spin(seconds):
    t = time.thread_time()
    while time.thread_time() - t < seconds:
        pass


def test_a_busy_thread_is_charged_its_cpu_under_its_name():
    stop, spun = threading.Event(), threading.Event()

    def busy():
        spin(0.1)
        spun.set()
        stop.wait()
    idle = threading.Thread(target=stop.wait, name="idle-one")
    worker = threading.Thread(target=busy, name="busy-one")
    idle.start()
    before = thread_cpu.snapshot()
    worker.start()
    assert spun.wait(30)
    d = thread_cpu.delta(before, thread_cpu.snapshot())     # while it lives: there by name
    stop.set()
    worker.join()
    idle.join()
    assert "busy-one" in d and d["busy-one"][0] >= 0.09 and d.get("idle-one", (0, 0))[0] < 0.01, d


def test_more_busy_threads_than_cores_wait_for_one():
    n = (os.cpu_count() or 1) + 2
    stop, started = threading.Event(), threading.Barrier(n + 1)

    block = bytes(1 << 20)

    def busy():
        started.wait()
        while not stop.is_set():     # hashing a large block releases the GIL: n threads want n cores
            hashlib.sha256(block).digest()
    threads = [threading.Thread(target=busy, name=f"w{i}") for i in range(n)]
    for t in threads:
        t.start()
    before = thread_cpu.snapshot()
    started.wait()
    time.sleep(0.3)
    d = thread_cpu.delta(before, thread_cpu.snapshot())
    stop.set()
    for t in threads:
        t.join()
    waits = [d[f"w{i}"][1] for i in range(n) if f"w{i}" in d]
    # n threads on n - 2 cores for 0.3 s: about 0.6 s queued in all; a tenth of it is plenty
    assert len(waits) == n and sum(waits) > 0.06, d


@pytest.mark.processes
def test_another_process_is_read_by_pid():
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<0.5: pass"])
    try:
        time.sleep(0.2)
        snap = thread_cpu.snapshot(p.pid)
        assert "main" in snap and snap["main"][0] > 0
    finally:
        p.wait()
    assert thread_cpu.snapshot(p.pid) == {}             # gone: nothing, no error
