"""Disaggregated serving with real processes on 127.0.0.1: `ouro serve --disagg 1P1D` (router +
a prefill and a decode worker) answers concurrent requests of mixed lengths through the OpenAI
client token for token as the single-process engine does, over tcp and shm; a request the
decode side cannot take fails with the right status and leaves nothing reserved; the metrics
show the transfers; and the workers stop with the router."""

import concurrent.futures as cf
import os
import signal
import time

import httpx

import pytest
import torch
from openai import OpenAI

from ouro import LLM, SamplingParams

from tests.helpers.serve_helpers import Server

pytestmark = pytest.mark.processes

LENGTHS = (3, 17, 64, 150, 33, 91, 8, 120)


def prompts():
    g = torch.Generator().manual_seed(21)
    return [torch.randint(5, 400, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint), dtype="float32", max_memory=64 << 20, page_size=16)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], SamplingParams(temperature=0, max_tokens=12))
    return [o.text for o in outs]


def completions(server, ps, max_tokens=12):
    client = OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)

    def one(p):
        r = client.completions.create(model="tiny", prompt=p, max_tokens=max_tokens, temperature=0)
        return r.choices[0].text
    with cf.ThreadPoolExecutor(len(ps)) as pool:
        return list(pool.map(one, ps))


def metric_of(m: dict, name: str):
    return next(v for k, v in m.items() if k.split("{")[0] == name)


def settled(server, want: dict, timeout=10, when=None):
    """The metrics once they show `want` and `when(get)` holds (the workers' heartbeats trail the
    replies a little, each worker's on its own clock: a gauge already at its final value may still be
    the other worker's last heartbeat)."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        got = {n: metric_of(m, n) for n in want}
        if (got == want and (when is None or when(lambda n: metric_of(m, n)))) or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def worker_pids(server):
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if b"--role" in cmd and f"{server.port}".encode() not in cmd and b"--exit-with-parent" in cmd:
                out.append(int(d))
    return out


@pytest.mark.slow       # a combination: 1P1D (above) and TP=2 (test_tp_engine) each run by default
def test_1p1d_with_tp2_answers_as_one_engine(tiny_checkpoint, tmp_path, reference):
    # --disagg with --tp: both workers run two ranks; prefill rank r sends its own shard (the
    # KDA state of its heads, the DSA rows) to decode rank r; rank 0 waits for the followers'
    # transfers before it reuses pages or decodes
    server = Server(tiny_checkpoint, "--served-model-name", "tiny", "--disagg", "1P1D", "--dtype", "float32",
                    "--tp", "2", tmp_path=tmp_path)
    try:
        assert completions(server, prompts()) == reference
        assert completions(server, prompts()[:3]) == reference[:3]      # pages reused on every rank
        m = settled(server, {"ouro:pd_transfers_completed": len(LENGTHS) + 3, "ouro:kv_pages_used": 0,
                             "ouro:pd_prefill_pages_used": 0},
                    when=lambda g: g("ouro:pd_kv_bytes_sent") == g("ouro:pd_kv_bytes_received") > 0)
        get = lambda name: metric_of(m, name)
        assert get("ouro:pd_transfers_completed") == len(LENGTHS) + 3 and get("ouro:pd_transfers_failed") == 0
        assert get("ouro:kv_pages_used") == 0 and get("ouro:pd_prefill_pages_used") == 0
        # rank 0 sent its shard: the DSA rows whole, the KDA state of its half of the heads
        ps = prompts() + prompts()[:3]
        assert get("ouro:pd_kv_bytes_sent") == get("ouro:pd_kv_bytes_received") == shard_bytes(tiny_checkpoint, ps, 2)
        assert shard_bytes(tiny_checkpoint, ps, 2) < shard_bytes(tiny_checkpoint, ps, 1)
        # the decode worker's follower dies: the next request fails at once, the server turns unhealthy
        os.kill(follower_of("decode", server), signal.SIGKILL)
        start = time.monotonic()
        r = httpx.post(server.base + "/v1/completions", json={"model": "tiny", "prompt": prompts()[0], "max_tokens": 4},
                       timeout=60)
        assert r.status_code >= 500 and "TP rank 1 of 2" in r.text, r.text
        assert time.monotonic() - start < 30
        while httpx.get(server.base + "/health", timeout=5).status_code == 200:
            assert time.monotonic() - start < 30, "the server still says it is healthy"
            time.sleep(0.3)
    finally:
        server.stop()


def follower_of(role: str, server) -> int:
    """The pid of the TP follower of this server's `role` worker."""
    from tests.helpers.serve_helpers import pids_running
    for pid in pids_running(b"ouro.disagg.tp_ranks"):
        with open(f"/proc/{pid}/stat") as f:
            parent = int(f.read().rsplit(")", 1)[1].split()[1])
        with open(f"/proc/{parent}/cmdline", "rb") as f:
            cmd = f.read().split(b"\0")
        if b"--role" in cmd and cmd[cmd.index(b"--role") + 1] == role.encode():
            with open(f"/proc/{parent}/stat") as f:
                grand = int(f.read().rsplit(")", 1)[1].split()[1])
            if grand == server.proc.pid:
                return pid
    raise AssertionError(f"no TP follower of a {role} worker of this server")


def shard_bytes(model_dir, ps, tp: int) -> int:
    """What one rank of `tp` sends for prompts `ps` (state_pieces.gather over a cache of its shape)."""
    from ouro.config import ModelConfig
    from ouro.disagg.state_pieces import block_bytes, gather, layer_pieces
    from ouro.layers.context import ModelCache
    from ouro.parallel.tp_shard import rank_config
    c = rank_config(ModelConfig.from_hf(model_dir), tp)
    total = 0
    for p in ps:
        pages = -(-len(p) // 16)
        cache = ModelCache(c, 1, pages, 16, dtype=torch.float32)
        total += sum(block_bytes(gather(cache, lp, list(range(pages)), 0, 0, len(p), True)) for lp in layer_pieces(c))
    return total


@pytest.mark.parametrize("backend", ["tcp", pytest.param("shm", marks=pytest.mark.slow),     # shm: also in-process,
                                     pytest.param("mooncake", marks=pytest.mark.slow)])   # test_disagg_engines
def test_1p1d_answers_as_one_engine(tiny_checkpoint, tmp_path, reference, backend):
    if backend == "mooncake":     # an optional package (one engine per process): skipped where it is not installed
        pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine is not installed")
    server = Server(tiny_checkpoint, "--served-model-name", "tiny", "--disagg", "1P1D", "--dtype", "float32",
                    "--transfer-backend", backend, tmp_path=tmp_path)
    try:
        assert completions(server, prompts()) == reference
        for body in ({"echo": True, "logprobs": 1}, {"prompt_logprobs": 0}, {"max_tokens": 0}):   # a single server's
            r = httpx.post(server.base + "/v1/completions", json={"prompt": prompts()[0], "max_tokens": 1, **body})
            assert r.status_code == 400 and "router" in r.json()["message"], r.text
        # the bytes each side counted: the prefill worker's heartbeat may trail the decode worker's
        same_bytes = (lambda g: g("ouro:pd_kv_bytes_received") == g("ouro:pd_kv_bytes_sent") > 0) if backend == "tcp" else None
        m = settled(server, {"ouro:pd_transfers_completed": len(LENGTHS), "ouro:kv_pages_used": 0,
                             "ouro:pd_prefill_pages_used": 0}, when=same_bytes)
        get = lambda name: metric_of(m, name)
        assert get("ouro:pd_transfers_completed") == len(LENGTHS) and get("ouro:pd_transfers_failed") == 0
        assert get("ouro:pd_transfer_latency_seconds_count") == len(LENGTHS)
        if backend == "tcp":
            assert get("ouro:pd_kv_bytes_received") == get("ouro:pd_kv_bytes_sent") > 0
        assert get("ouro:kv_pages_used") == 0 and get("ouro:pd_decode_rooms") == 0
        assert get("ouro:pd_prefill_pages_used") == 0 and get("ouro:pd_prefill_held_requests") == 0
    finally:
        server.stop()


@pytest.mark.slow
def test_refusals_carry_their_status_and_reserve_nothing(tiny_checkpoint, tmp_path):
    server = Server(tiny_checkpoint, "--served-model-name", "tiny", "--disagg", "1P1D", "--dtype", "float32",
                    "--max-model-len", "200", tmp_path=tmp_path)
    try:
        client = OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)
        with pytest.raises(Exception) as e:          # prompt + max_tokens past the context: the decode side says 400
            client.completions.create(model="tiny", prompt=list(range(5, 195)), max_tokens=50)
        assert getattr(e.value, "status_code", None) == 400 and "context" in str(e.value)
        assert completions(server, [prompts()[1]], 4)[0]
        m = settled(server, {"ouro:pd_decode_rooms": 0, "ouro:kv_pages_used": 0})
        assert [v for k, v in m.items() if k.startswith(("ouro:pd_decode_rooms", "ouro:kv_pages_used"))] == [0, 0]
        pids = worker_pids(server)
        assert len(pids) == 2
    finally:
        server.stop()
    deadline = time.monotonic() + 15
    while any(os.path.exists(f"/proc/{p}") for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if os.path.exists(f"/proc/{p}")], "workers outlived the router"


@pytest.mark.slow
def test_bench_serve_compares_two_servers_in_alternating_rounds(tiny_checkpoint, tmp_path):
    import argparse
    from ouro.bench.serve_compare import compare_serve, format_compare
    single = Server(tiny_checkpoint, "--served-model-name", "tiny", "--dtype", "float32", tmp_path=tmp_path)
    pd = Server(tiny_checkpoint, "--served-model-name", "tiny", "--disagg", "1P1D", "--dtype", "float32", tmp_path=tmp_path)
    try:
        args = argparse.Namespace(base_url=single.base, compare_base_url=pd.base, api_key=None, model=None,
                                  vocab_range="5,400", num_prompts=6, input_len=40, output_len=6, seed=0,
                                  endpoint="/v1/completions", request_rate=float("inf"), max_concurrency=3, repeats=2,
                                  disable_tqdm=True)
        r = compare_serve(args)
    finally:
        single.stop()
        pd.stop()
    assert [len(r["rounds"][s]) for s in "AB"] == [2, 2]
    assert all(x["failed"] == 0 for s in "AB" for x in r["rounds"][s])
    for k in ("output_throughput", "ttft"):
        assert r["b_over_a"][k] == r["median"]["B"][k] / r["median"]["A"][k]
    assert f"{r['b_over_a']['output_throughput']:.3f}" in format_compare(r)
