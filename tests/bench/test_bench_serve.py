"""`ouro bench serve` against a real tiny server, through the CLI in a subprocess: the JSON's
figures agree with its own per-request records (counts, throughputs, percentiles, ratios), the
concurrency limit and the arrival times hold, and the metric arithmetic matches hand-computed
values."""

import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from ouro.bench.load_gen import arrival_offsets, carries_tokens, make_prompts
from ouro.bench.serve import calculate_metrics, overhead_ratios, percentile

N, IN, OUT, CONC = 12, 32, 8, 4


@pytest.fixture(scope="module")
def tiny_dir(tiny_checkpoint):
    return tiny_checkpoint


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    from tests.helpers.serve_helpers import Server
    s = Server(tiny_dir, tmp_path=tmp_path_factory.mktemp("bench_serve_logs"))
    yield s
    s.stop()


RATE = 20.0
RUNS = {"all_at_once": ["--request-rate", "inf"],
        "poisson_offline": ["--request-rate", str(RATE), "--compare-offline", "{tiny}",
                            "--offline-max-memory", str(64 << 20), "--offline-page-size", "16"]}


@pytest.fixture(scope="module")
def runs(server, tiny_dir, tmp_path_factory):
    """name -> (JSON, printed table) of each `ouro bench serve` run in RUNS. The runs go side by
    side (start-up is most of their time); each one's figures only depend on its own records."""
    d, procs = tmp_path_factory.mktemp("bench_serve_out"), {}
    env = {**os.environ, "OURO_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    for name, extra in RUNS.items():
        cmd = [sys.executable, "-m", "ouro.cli", "bench", "serve", "--base-url", server.base, "--num-prompts",
               str(N), "--random-input-len", str(IN), "--random-output-len", str(OUT), "--max-concurrency", str(CONC),
               "--seed", "3", "--output-json", str(d / f"{name}.json"), "--disable-tqdm",
               *[a.format(tiny=tiny_dir) for a in extra]]
        procs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stdout + stderr
        out[name] = json.loads((d / f"{name}.json").read_text()), stdout
    return out


def table_value(text: str, label: str) -> float:
    return float(re.search(re.escape(label) + r"\s+([-\d.]+)", text).group(1))


def check_run(r: dict, table: str) -> None:
    m, recs = r["metrics"], r["requests"]
    assert m["completed"] == N and m["failed"] == 0 and len(recs) == N
    assert all(x["success"] and x["usage_reported"] for x in recs)
    assert [x["output_tokens"] for x in recs] == [OUT] * N            # from the usage chunk
    assert m["total_output_tokens"] == N * OUT and m["total_input_tokens"] == N * IN
    d = m["duration_s"]
    assert m["request_throughput"] == pytest.approx(N / d)
    assert m["output_throughput"] == pytest.approx(N * OUT / d)
    assert m["input_throughput"] == pytest.approx(N * IN / d)
    assert m["total_token_throughput"] == pytest.approx(N * (IN + OUT) / d)
    for x in recs:
        assert 0 < x["ttft"] < x["e2e"]
        assert x["start"] + x["e2e"] <= d + 1e-6                         # inside the timed run
        assert len(x["itl"]) == x["chunks"] - 1 and x["chunks"] <= x["output_tokens"]
        assert x["ttft"] + sum(x["itl"]) <= x["e2e"] + 1e-9
    # the metrics are what the records say
    tpot = [(x["e2e"] - x["ttft"]) / (x["output_tokens"] - 1) for x in recs]
    for key, values in (("ttft_ms", [x["ttft"] for x in recs]), ("e2el_ms", [x["e2e"] for x in recs]),
                        ("itl_ms", [g for x in recs for g in x["itl"]]), ("tpot_ms", tpot)):
        s = m[key]
        assert s["count"] == len(values)
        assert s["median"] == pytest.approx(1e3 * float(np.median(values)))
        assert s["p99"] == pytest.approx(1e3 * float(np.percentile(values, 99)))
        assert s["mean"] == pytest.approx(1e3 * float(np.mean(values)))
        assert s["min"] <= s["median"] <= s["p99"] <= s["max"] and s["min"] <= s["mean"] <= s["max"]
    # at most --max-concurrency in flight at any moment
    events = sorted([(x["start"], 1) for x in recs] + [(x["start"] + x["e2e"], -1) for x in recs],
                    key=lambda e: (e[0], e[1]))
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    assert peak <= CONC
    # the printed table says what the JSON says
    assert table_value(table, "Successful requests:") == N
    assert table_value(table, "Total generated tokens:") == N * OUT
    assert table_value(table, "Median TTFT (ms):") == pytest.approx(m["ttft_ms"]["median"], abs=0.006)
    assert table_value(table, "P99 ITL (ms):") == pytest.approx(m["itl_ms"]["p99"], abs=0.006)


@pytest.mark.processes
def test_bench_serve_all_at_once(runs):
    r, table = runs["all_at_once"]
    check_run(r, table)
    assert r["request_rate"] == "inf" and r["vocab_range"] == [300, 500]
    # all arrive at 0: the first CONC are sent at once, the rest wait for a free place
    starts = sorted(x["start"] for x in r["requests"])
    assert starts[CONC - 1] < 0.5 * r["metrics"]["duration_s"]
    assert "offline" not in r


@pytest.mark.processes
def test_bench_serve_poisson_and_offline(runs):
    r, table = runs["poisson_offline"]
    check_run(r, table)
    assert r["request_rate"] == RATE
    offsets = arrival_offsets(N, RATE, 3)
    assert all(x["start"] >= t - 1e-3 for x, t in zip(r["requests"], offsets))   # never before its arrival
    assert r["vocab_range"] == [256, 512]            # min(1000, V // 2), V from the tiny checkpoint
    o, q, m = r["offline"], r["ratios"], r["metrics"]
    assert o["output_tokens"] == N * OUT and o["max_num_seqs"] == CONC and o["prefill_tokens"] == IN
    assert o["output_throughput"] == pytest.approx(N * OUT / o["duration_s"])
    assert 0 < o["decode_steps"] < o["steps"] and o["decode_step_ms"] > 0 and o["prefill_ms"] > 0
    assert q["output_throughput"] == pytest.approx(m["output_throughput"] / o["output_throughput"])
    assert q["itl_over_decode_step"] == pytest.approx(m["itl_ms"]["median"] / o["decode_step_ms"])
    assert q["ttft_over_prefill"] == pytest.approx(m["ttft_ms"]["median"] / o["prefill_ms"])
    assert table_value(table, "Output throughput ratio:") == pytest.approx(q["output_throughput"], abs=6e-4)


def test_metric_arithmetic_by_hand():
    def rec(ok, prompt, out, ttft, e2e, itl):
        return {"success": ok, "prompt_tokens": prompt, "output_tokens": out, "ttft": ttft, "e2e": e2e, "itl": itl}
    records = [rec(True, 10, 3, 0.1, 0.5, [0.2, 0.2]),
               rec(True, 10, 5, 0.2, 1.4, [0.1, 0.3, 0.2, 0.2]),
               rec(False, 10, 0, 0.0, 0.0, []),             # failed: counted, not measured
               rec(True, 10, 1, 0.3, 0.3, [])]              # one token: no TPOT
    m = calculate_metrics(records, duration=2.0)
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (3, 1, 30, 9)
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["input_throughput"] == pytest.approx(15.0)
    assert m["output_throughput"] == pytest.approx(4.5)
    assert m["total_token_throughput"] == pytest.approx(19.5)
    approx = lambda d: {k: pytest.approx(v) for k, v in d.items()}   # noqa: E731
    # TTFT 100, 200, 300 ms: p99 at rank 2 * 0.99 = 1.98 -> 200 + 0.98 * 100
    assert {k: m["ttft_ms"][k] for k in ("mean", "median", "p99")} == approx({"mean": 200, "median": 200, "p99": 298})
    # TPOT (500 - 100) / 2 = 200 and (1400 - 200) / 4 = 300 ms
    assert {k: m["tpot_ms"][k] for k in ("mean", "median", "p99", "count")} == \
        approx({"mean": 250, "median": 250, "p99": 299, "count": 2})
    # ITL 100, 200 x4, 300 ms: p99 at rank 5 * 0.99 = 4.95 -> 200 + 0.95 * 100
    assert {k: m["itl_ms"][k] for k in ("mean", "median", "p99", "count")} == \
        approx({"mean": 200, "median": 200, "p99": 295, "count": 6})
    # E2E 300, 500, 1400 ms: p99 = 500 + 0.98 * 900
    assert {k: m["e2el_ms"][k] for k in ("mean", "median", "p99")} == \
        approx({"mean": 2200 / 3, "median": 500, "p99": 1382})
    q = overhead_ratios(m, {"output_throughput": 9.0, "decode_step_ms": 50.0, "prefill_ms": 400.0})
    assert q == approx({"output_throughput": 0.5, "itl_over_decode_step": 4.0, "ttft_over_prefill": 0.5})
    empty = calculate_metrics([records[2]], duration=1.0)
    assert empty["completed"] == 0 and empty["ttft_ms"]["median"] is None
    assert overhead_ratios(empty, {"output_throughput": 9.0, "decode_step_ms": 50.0, "prefill_ms": 400.0}) == \
        {"output_throughput": 0.0, "itl_over_decode_step": None, "ttft_over_prefill": None}


def test_percentile_matches_numpy():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        xs = rng.exponential(size=n).tolist()
        for q in (0, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_prompts_arrivals_and_chunks():
    a, b = make_prompts(5, 7, (300, 310), 1), make_prompts(5, 7, (300, 310), 1)
    assert a == b and len(a) == 5 and all(len(p) == 7 and all(300 <= t < 310 for t in p) for p in a)
    assert make_prompts(5, 7, (300, 310), 2) != a
    assert arrival_offsets(4, math.inf, 0) == [0.0] * 4
    t = arrival_offsets(20000, 5.0, 0)
    assert t[0] == 0 and all(x <= y for x, y in zip(t, t[1:]))
    assert t[-1] / (len(t) - 1) == pytest.approx(0.2, rel=0.05)       # mean gap 1 / rate
    assert arrival_offsets(50, 5.0, 0) == arrival_offsets(50, 5.0, 0) != arrival_offsets(50, 5.0, 1)
    # a chunk per engine output carries tokens even with its text held back; the closing one does not
    assert carries_tokens({"text": "ab", "finish_reason": None})
    assert carries_tokens({"text": "", "finish_reason": None})
    assert carries_tokens({"text": "x", "finish_reason": "length"})
    assert not carries_tokens({"text": "", "finish_reason": "length"})
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0, 0)
    with pytest.raises(ValueError):
        make_prompts(3, 4, (10, 10), 0)
