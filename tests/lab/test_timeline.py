"""The span tracer, its Chrome trace, and the timeline probe: a planted GIL hog (the engine
process's output sender made to poll instead of block) is named, clean ouro gives no warning."""

import json
import threading

import pytest
import zmq

from ouro.measure import heartbeat, spans
from ouro.measure.chrome_trace import heartbeats_of, merge, spans_of
from ouro.lab.findings import sort_findings
from ouro.lab.timeline.probe import timeline
from ouro.lab.timeline.analysis import analyse, overlap
from ouro.models.resolve import resolve_model
from ouro.serve import engine_process
from ouro.serve.messages import encode, output_to_wire


@pytest.fixture
def tracer():
    spans.clear()
    spans.enable()
    yield
    spans.disable()
    spans.clear()


def test_spans_per_thread_and_chrome_trace(tracer, tmp_path):
    @spans.span("work", cat="compute")
    def work():
        with spans.span("inner", cat="transfer"):
            pass

    work()
    t = threading.Thread(target=work, name="side-thread")
    t.start()
    t.join()
    ev = spans.events()
    assert [e["name"] for e in ev].count("work") == 2 and {e["thread"] for e in ev} >= {"side-thread"}
    path = spans.save(str(tmp_path / "t.json"))
    doc = json.load(open(path))
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == 4 and all({"pid", "tid", "ts", "dur"} <= set(e) for e in xs)
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert "side-thread" in names
    # merging two processes' traces keeps every span
    merged = merge([path, path, str(tmp_path / "missing.json")], str(tmp_path / "m.json"))
    assert len(spans_of(json.load(open(merged)))) == 8
    spans.disable()
    spans.clear()
    work()
    assert spans.events() == []          # off: nothing recorded


def test_analysis_finds_idle_gap_and_overlap():
    pid = 7
    s = lambda name, cat, a, b, tid=1: {"name": name, "cat": cat, "start_ms": a, "dur_ms": b - a, "end_ms": b,
                                        "pid": pid, "tid": tid, "thread": f"t{tid}", "process": "p"}
    trace = [s("pending", "pending", 0, 100), s("step", "step", 0, 10), s("step", "step", 12, 20),
             s("step", "step", 70, 80), s("step", "step", 80, 100),
             s("execute", "compute", 0, 10), s("send", "transfer", 5, 15, tid=2)]
    findings = sort_findings(analyse(trace, {}))
    gap = next(f for f in findings if "idle" in f.summary)
    assert gap.where["interval"] == [20.0, 70.0] and gap.where["thread"] == "t1"
    assert gap.severity == "warning"    # half the pending time idle, 5 steps long
    assert overlap(trace, "transfer", "compute") == pytest.approx(0.5)


def test_a_poller_spinning_all_along_is_not_taken_for_the_baseline():
    """A hog that spins while the engine is idle too makes idle wakes late as well: those wakes
    must not become the 'normal' delay that the starved spans are compared with."""
    hog = {"thread": "poller", "tid": 9, "where": {"file": "x.py", "function": "poll", "line": 3}}
    samples, late = [], []
    for i in range(200):
        t, d = float(i * 6), (10.0 if 100 <= i < 160 else 5.0)     # late everywhere, worse in forward
        samples.append((t, d))
        late.append({"at_ms": t, "delay_ms": d, "interval_ms": 6.0, "threads": [dict(hog, cpu_ms=5.5)]})
    span = {"name": "forward", "cat": "compute", "start_ms": 600.0, "end_ms": 959.0, "dur_ms": 359.0,
            "pid": 1, "tid": 1, "thread": "MainThread", "process": "p"}
    findings = sort_findings(analyse([span], {1: {"samples": samples, "late": late}}))
    top = findings[0]
    assert top.severity == "warning" and top.where["function"] == "poll", [f.summary for f in findings]
    # the same delays with nobody else running are the OS's noise: no culprit, no warning
    for s in late:
        s["threads"] = []
    assert all(f.severity == "info" for f in analyse([span], {1: {"samples": samples, "late": late}}))


def starved_trace(wakes: int, every_ms: float):
    """A heartbeat that woke only `wakes` times, `every_ms` apart, each late by nearly that, while a
    poller ran Python: what a spinning thread does to a short prefill on a fast machine."""
    hog = {"thread": "poller", "tid": 9, "where": {"file": "x.py", "function": "poll", "line": 3}}
    samples = [(i * every_ms, every_ms - 1.0) for i in range(wakes)]
    late = [{"at_ms": t, "delay_ms": d, "interval_ms": every_ms, "threads": [dict(hog, cpu_ms=every_ms * 0.9)]}
            for t, d in samples]
    span = {"name": "forward", "cat": "compute", "start_ms": 0.0, "end_ms": wakes * every_ms, "dur_ms": wakes * every_ms,
            "pid": 1, "tid": 1, "thread": "MainThread", "process": "p"}
    return [span], {1: {"period_ms": 1.0, "samples": samples, "late": late}}


def test_a_starved_heartbeat_that_woke_rarely_is_the_finding():
    """18 wakes over 0.9 s (due: ~900) is starvation, not too little evidence; a watch shorter than
    MIN_WATCH_PERIODS heartbeat periods says nothing."""
    findings = sort_findings(analyse(*starved_trace(18, 50.0)))
    assert findings[0].severity == "warning" and findings[0].where["function"] == "poll", [f.summary for f in findings]
    assert all(f.severity == "info" for f in analyse(*starved_trace(6, 1.5)))


def _sender_with(monkeypatch, wait=None):
    """The engine process's real output sender on a real (in-process) ZeroMQ pair."""
    if wait is not None:
        monkeypatch.setattr(engine_process, "_next_item", wait)
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    pull.bind("inproc://outputs")
    push.connect("inproc://outputs")
    return engine_process.OutputSender(push, encode, output_to_wire), ctx


def spin_wait(q):
    """The planted fault: the sender polls its queue, holding the GIL while it waits."""
    while q.empty():
        pass
    return q.get_nowait()


@pytest.mark.slow     # 46 s on 2 cores (the spinning thread slows everything); the fault suite runs it too
def test_planted_gil_hog_is_named(monkeypatch):
    from ouro.lab import scenarios
    scenarios._engine(str(resolve_model("tiny")))          # load before the hog starts
    sender, ctx = _sender_with(monkeypatch, spin_wait)
    try:
        for _ in range(2):    # a loaded machine can leave too few late heartbeats in one short run
            findings = sort_findings(timeline("tiny", requests=1, max_tokens=3))
            if findings[0].severity == "warning":
                break
    finally:
        sender.close()
        ctx.destroy(linger=0)
    top = findings[0]
    assert top.severity == "warning" and "GIL" in top.summary, [f.summary for f in findings]
    assert top.where["thread"] == "ouro-output-sender"
    assert top.where["function"] == "spin_wait" and top.where["file"] == "tests/lab/test_timeline.py"
    assert top.where["interval"][1] > top.where["interval"][0]


def test_clean_ouro_gives_no_warning(monkeypatch, tmp_path):
    sender, ctx = _sender_with(monkeypatch)                  # the real sender, blocked in queue.get
    try:
        findings = timeline("tiny", requests=3, max_tokens=6, trace_out=str(tmp_path / "t.json"))
    finally:
        sender.close()
        ctx.destroy(linger=0)
    bad = [f.summary for f in findings if f.severity != "info"]
    assert not bad, bad
    doc = json.load(open(tmp_path / "t.json"))
    names = {s["name"] for s in spans_of(doc)}
    assert {"schedule", "execute", "forward", "sample", "outputs", "step"} <= names
    assert any(len(h["samples"]) > 10 for h in heartbeats_of(doc).values())
    again = timeline(from_trace=str(tmp_path / "t.json"))
    assert [f.summary for f in again] == [f.summary for f in findings]


@pytest.mark.processes
@pytest.mark.slow
def test_serve_scenario_merges_both_processes(tmp_path):
    findings = timeline("tiny", scenario="serve", requests=3, max_tokens=4, trace_out=str(tmp_path / "s.json"))
    assert not [f.summary for f in findings if f.severity != "info"]
    doc = json.load(open(tmp_path / "s.json"))
    procs = {s["process"] for s in spans_of(doc)}
    assert procs == {"ouro frontend", "ouro engine"}
    names = {s["name"] for s in spans_of(doc)}
    assert {"request", "detokenize", "step", "send", "recv", "pending"} <= names
    assert heartbeat.NAME in {e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"}


def test_own_location_stops_at_a_link_that_is_not_a_frame():
    """A racing thread's frame chain once ended in a function object (CI, Python 3.11): no crash."""
    import sys
    here = heartbeat.own_location(sys._getframe())
    assert here is not None and here["function"] == "test_own_location_stops_at_a_link_that_is_not_a_frame"
    assert heartbeat.own_location(len) is None
