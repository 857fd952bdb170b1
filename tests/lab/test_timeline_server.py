"""Tracing a running `ouro serve` on demand: /start_trace and /stop_trace give one Chrome trace of
both processes (with heartbeat samples), without disturbing requests in flight; the API key
guards them; `ouro probe timeline --url` and `ouro probe budgets --url` run against the server."""

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from ouro.measure import spans
from ouro.lab.budgets import check_budgets
from ouro.measure.chrome_trace import heartbeats_of, spans_of
from ouro.lab.scenarios import prompts, stream_completions
from tests.helpers.serve_helpers import Server, post

KEY = "trace-key"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    s = Server(tiny_checkpoint, "--max-num-seqs", "8", tmp_path=tmp_path_factory.mktemp("trace_logs"), api_key=KEY)
    yield s
    s.stop()


@pytest.mark.processes
def test_stop_without_start_is_409_with_the_openai_error_body(server):
    r = post(server, "/stop_trace", None)
    assert r.status_code == 409
    body = r.json()
    assert body["object"] == "error" and body["code"] == 409 and body["type"] == "ConflictError"
    assert "/start_trace" in body["message"]


@pytest.mark.processes
def test_api_key_guards_the_trace_routes(server):
    assert post(server, "/start_trace", {"heartbeat": True}, key=None).status_code == 401
    assert post(server, "/start_trace", {}, key="wrong").status_code == 401
    assert post(server, "/stop_trace", None, key="wrong").status_code == 401
    assert post(server, "/stop_trace", None).status_code == 409        # the refused start started nothing
    assert post(server, "/start_trace", {"heartbeat": "yes"}).status_code == 400


@pytest.mark.processes
def test_trace_on_demand_has_both_processes_and_heartbeats(server):
    r = post(server, "/start_trace", {"heartbeat": True})
    assert r.status_code == 200 and r.json()["heartbeat"] is True
    assert post(server, "/start_trace", None).status_code == 409         # one trace at a time
    time.sleep(0.1)
    records = stream_completions(server.base, prompts(3, seed=1), 4, 60, server.headers())
    assert len(records) == 3 and all(r["chunks"] >= 4 for r in records)
    doc = post(server, "/stop_trace", None).json()
    found = spans_of(doc)
    pids = {s["pid"] for s in found}
    assert pids == {server.proc.pid, server.engine_pid}                   # frontend and engine process
    assert {s["process"] for s in found} == {"ouro frontend", "ouro engine"}
    assert {"request", "detokenize", "step", "recv", "send", "pending"} <= {s["name"] for s in found}
    beats = heartbeats_of(doc)
    assert set(beats) == pids, beats.keys()
    assert all(len(b["samples"]) > 20 for b in beats.values()), {p: len(b["samples"]) for p, b in beats.items()}
    caps = [e["args"] for e in doc["traceEvents"] if e.get("name") == "ouro_trace"]
    assert len(caps) == 2 and all(c["dropped_oldest_events"] == 0 for c in caps)
    assert post(server, "/stop_trace", None).status_code == 409          # stopped: nothing to stop twice


def _stream(server, max_tokens, out, first):
    body = {"prompt": prompts(1, seed=2)[0], "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    chunks = 0
    with httpx.stream("POST", server.base + "/v1/completions", json=body, headers=server.headers(), timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks += 1
                first.set()
                reason = json.loads(line[6:])["choices"][0].get("finish_reason")
                out["finish_reason"] = reason or out.get("finish_reason")
            elif line == "data: [DONE]":
                out["done"] = True
    out["chunks"] = chunks


@pytest.mark.processes
def test_start_and_stop_leave_a_request_in_flight_alone(server):
    out, first = {}, threading.Event()
    t = threading.Thread(target=_stream, args=(server, 160, out, first))
    t.start()
    assert first.wait(30)
    assert post(server, "/start_trace", {}).status_code == 200
    time.sleep(0.2)
    doc = post(server, "/stop_trace", None).json()
    t.join(60)
    assert out["done"] and out["finish_reason"] == "length" and out["chunks"] >= 160
    assert any(s["name"] == "step" for s in spans_of(doc))              # traced while it ran
    assert not heartbeats_of(doc)                                        # no heartbeat unless asked


def test_event_cap_drops_the_oldest_and_says_so():
    old = spans.MAX_EVENTS
    spans.set_max_events(5)
    try:
        spans.enable()
        for i in range(12):
            spans.record(f"s{i}", "misc", i * 1000, i * 1000 + 10)
        spans.disable()
        events = spans.chrome_events(process_name="capped")
        assert [e["name"] for e in events if e["ph"] == "X"] == [f"s{i}" for i in range(7, 12)]
        cap = next(e["args"] for e in events if e["name"] == "ouro_trace")
        assert cap == {"max_events": 5, "dropped_oldest_events": 7}
    finally:
        spans.disable()
        spans.set_max_events(old)


def _probe_timeline(server, out, trace):
    return subprocess.run([sys.executable, "-m", "ouro.cli", "probe", "timeline", "--url", server.base,
                           "--api-key", KEY, "--requests", "3", "--max-tokens", "6", "--trace-out", str(trace),
                           "--json", str(out), "--fail-on", "warning"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.processes
def test_probe_timeline_url_on_clean_ouro_gives_no_warning(server, tmp_path):
    out = tmp_path / "findings.json"
    trace = tmp_path / "t.json"
    r = _probe_timeline(server, out, trace)
    if r.returncode == 1:
        # on a loaded 2-core machine the GIL analysis now and then (~1 run in 6) flags the engine's
        # main thread, busy in the model, during a short `send`: a second clean run must pass
        r = _probe_timeline(server, out, trace)
    assert r.returncode == 0, r.stdout + r.stderr
    findings = json.load(open(out))["findings"]
    assert findings and not [f["summary"] for f in findings if f["severity"] != "info"]
    assert {s["process"] for s in spans_of(json.load(open(trace)))} == {"ouro frontend", "ouro engine"}


@pytest.mark.processes
def test_probe_budgets_url_measures_the_running_server(server, tmp_path):
    path = tmp_path / "b.toml"
    path.write_text('[[budget]]\nname = "ttft"\nscenario = "serve"\ncheck = "ttft_p50_ms <= 60000"\n\n'
                    '[[budget]]\nname = "impossible tpot"\nscenario = "serve"\ncheck = "tpot_ms < 0"\n')
    findings = check_budgets(str(path), url=server.base, api_key=KEY)
    failed, passed = findings
    assert failed.severity == "warning" and "impossible tpot" in failed.summary
    assert failed.evidence["url"] == server.base and "--url" in failed.next
    assert passed.severity == "info" and passed.evidence["url"] == server.base
    assert post(server, "/stop_trace", None).status_code == 409          # the probe stopped its trace
