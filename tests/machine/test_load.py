"""A choice timed while other processes used the CPUs is not cached (`ouro.machine.load`): the
meter against a real busy process, the rule, and each picker (gemm forms, dtype, int8 forms)
keeping a quiet measurement and dropping a busy one."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from ouro.machine import dtype_pick, gemm_pick, load
from ouro.quant import int8_forms


def _spin(seconds: float):
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        pass


@pytest.mark.processes
@pytest.mark.skipif(not load._machine_ticks(), reason="needs Linux's /proc/stat")
def test_meter_sees_other_processes_and_not_its_own_work(monkeypatch):
    """Adjacent windows: this process idle, this process busy (not others' load: no rise), every CPU
    taken by other processes (a rise). Differences, so a test worker beside it shifts all alike."""
    monkeypatch.delenv("OURO_BUSY_LIMIT", raising=False)
    for _ in range(10):              # the suite's other workers may hold every CPU for a while
        with load.OtherLoad() as idle:
            time.sleep(0.4)
        if idle.share is not None and idle.share < 0.6:
            break
        time.sleep(1.0)
    else:
        pytest.skip(f"other processes held the CPUs throughout ({idle.share}); the arithmetic is tested below")
    with load.OtherLoad() as own:
        _spin(0.4)
    code = "import time\nt=time.perf_counter()\nwhile time.perf_counter()-t<1.2: pass\n"
    hogs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.2)                              # the interpreters started
        with load.OtherLoad() as other:
            time.sleep(0.6)
    finally:
        for h in hogs:
            h.wait()
    assert None not in (idle.share, own.share, other.share)
    assert own.share - idle.share < 0.25, (idle.share, own.share)
    assert other.share - idle.share > 0.3 and other.busy, (idle.share, other.share)


def test_share_is_others_busy_ticks_over_all_ticks(monkeypatch):
    """The arithmetic on scripted /proc counters: machine busy 150 of 200 ticks, this process 50."""
    machine = iter([(1000, 5000), (1150, 5200)])
    own = iter([300, 350])
    monkeypatch.setattr(load, "_machine_ticks", lambda: next(machine))
    monkeypatch.setattr(load, "_own_ticks", lambda: next(own))
    monkeypatch.delenv("OURO_BUSY_LIMIT", raising=False)
    with load.OtherLoad() as m:
        pass
    assert m.share == 0.5 and m.busy


def test_a_window_too_short_says_nothing():
    with load.OtherLoad() as m:
        pass
    assert m.share is None and not m.busy


def test_limit_from_the_environment(monkeypatch):
    monkeypatch.delenv("OURO_BUSY_LIMIT", raising=False)
    assert load.busy_limit() == load.BUSY_LIMIT
    monkeypatch.setenv("OURO_BUSY_LIMIT", "0.5")
    assert load.busy_limit() == 0.5
    monkeypatch.setenv("OURO_BUSY_LIMIT", "lots")
    with pytest.raises(ValueError, match="OURO_BUSY_LIMIT"):
        load.busy_limit()


@pytest.fixture
def meter(monkeypatch, tmp_path):
    """Every picker's meter reports `share[0]`; a fresh cache; the default limit."""
    monkeypatch.setenv("OURO_CACHE", str(tmp_path))
    monkeypatch.delenv("OURO_BUSY_LIMIT", raising=False)
    share = [0.0]

    class Fixed(load.OtherLoad):
        def __exit__(self, *exc):
            self.share = share[0]
            return False
    for mod in (gemm_pick, dtype_pick, int8_forms):
        monkeypatch.setattr(mod, "OtherLoad", Fixed)
    monkeypatch.setattr(load, "quiet_now", lambda: share[0] <= load.busy_limit())    # the machine now
    return share


def _gemm(monkeypatch, calls):
    monkeypatch.delenv("OURO_GEMM_PICK", raising=False)
    monkeypatch.setattr(gemm_pick, "packable", lambda w: False)
    monkeypatch.setattr(gemm_pick, "gemv_runs", lambda w: False)
    monkeypatch.setattr(gemm_pick, "panels_runs", lambda w: False)

    def fake(form, weight, rows, budget_s=0.03):
        calls.append(form)
        return {"linear": 2.0, "transposed": 1.0}[form]
    monkeypatch.setattr(gemm_pick, "time_form", fake)
    return lambda: gemm_pick.pick_forms(torch.zeros(64, 8))


def _dtype(monkeypatch, calls):
    monkeypatch.delenv("OURO_DTYPE_AUTO", raising=False)

    def fake(name, device, budget_s=0.15):
        calls.append(name)
        return {"bfloat16": 5e11, "float32": 1e11}[name]
    monkeypatch.setattr(dtype_pick, "gemm_rate", fake)
    return lambda: [dtype_pick.pick_dtype("cpu")]


def _int8(monkeypatch, calls):
    monkeypatch.delenv("OURO_INT8_FORM", raising=False)
    forms = ("int_mm", "chunked")                   # no native build in the fresh cache
    monkeypatch.setattr(int8_forms, "available_forms", lambda device="cpu": forms)

    def timer(f, r):
        calls.append(f)
        return 1.0 + forms.index(f)
    return lambda: int8_forms.pick_forms("cpu", timer=timer)


@pytest.mark.parametrize("picker, file", [(_gemm, gemm_pick.FILE), (_dtype, dtype_pick.FILE),
                                          (_int8, int8_forms.FILE)])
def test_busy_measurement_is_provisional_until_a_quiet_start(meter, monkeypatch, tmp_path, picker, file, caplog):
    calls = []
    pick = picker(monkeypatch, calls)
    meter[0] = 0.9                                    # a test suite running beside it
    load._said.discard(file)
    first = pick()
    n = len(calls)
    saved = json.loads((tmp_path / file).read_text())
    assert n and [(e["other_load"], e.get("provisional")) for e in saved.values()] == [(0.9, True)]
    assert any("kept as provisional" in r.message for r in caplog.records)
    assert pick() == first and len(calls) == n        # still busy: the provisional choice, not timed again
    meter[0] = 0.05                                   # quiet
    assert pick() == first and len(calls) == 2 * n    # timed again, now for good
    saved = json.loads((tmp_path / file).read_text())
    assert [(e["other_load"], e.get("provisional")) for e in saved.values()] == [(0.05, None)]
    meter[0] = 0.9
    assert pick() == first and len(calls) == 2 * n    # a settled choice is read back, busy or not
    meter[0] = 0.05
    assert pick() == first and len(calls) == 2 * n


def test_quiet_now_is_sampled_once_per_process(monkeypatch):
    monkeypatch.setattr(load, "_quiet", [])
    seen = []

    class Fixed(load.OtherLoad):
        def __exit__(self, *exc):
            seen.append(1)
            self.share = 0.9
            return False
    monkeypatch.setattr(load, "OtherLoad", Fixed)
    monkeypatch.delenv("OURO_BUSY_LIMIT", raising=False)
    assert load.quiet_now() is False and load.quiet_now() is False and len(seen) == 1
    assert load.settled({"forms": ["linear"]}) and load.settled({"provisional": True})   # busy: use it


def test_an_entry_from_before_the_check_is_timed_again(meter, monkeypatch, tmp_path):
    """A gemm entry of the previous format (timed perhaps under load) is not trusted."""
    calls = []
    pick = _gemm(monkeypatch, calls)
    pick()
    path = tmp_path / gemm_pick.FILE
    saved = json.loads(path.read_text())
    for e in saved.values():
        e["format"] = gemm_pick.FORMAT - 1
        e["forms"] = ["linear"] * len(gemm_pick.ROWS)
    path.write_text(json.dumps(saved))
    n = len(calls)
    assert pick() == ["transposed"] * len(gemm_pick.ROWS) and len(calls) == 2 * n
