"""The encode role under abuse, as separate processes on 127.0.0.1 (`ouro serve --role encode`,
`--role prefill`, `--role decode`, `ouro router --encode`): 120 chat requests, 12 at a time, half
with images (four images, some repeated, one request with two); some clients hang up early; the
encode worker is killed (SIGKILL) a third of the way in and a new one started at two thirds.
Every completed reply equals offline generation for its request; every failure is an HTTP error
with the OpenAI error body; text requests keep being served while no encode worker is up; image
requests are served again once the new one is; every pool, room and image wait is released."""

import concurrent.futures as cf
import random
import signal
import threading
import time

import httpx
import pytest

from ouro.disagg.command import free_port_pair, stop_all
from ouro.lab.serve_scenarios import wait_ready
from ouro.models.resolve import resolve_model

from tests.helpers.image_helpers import data_uri, offline_tokens, png
from tests.helpers.serve_helpers import free_port
from tests.helpers.disagg_processes import health, metric, settled, start

pytestmark = pytest.mark.processes

N_REQUESTS, CONCURRENCY, N_TOKENS = 120, 12, 5


def worker_args(ckpt, role, port, *extra):
    return ["serve", "--role", role, "--model", str(ckpt), "--port", str(port), "--dtype", "float32",
            "--max-memory", str(64 << 20), "--page-size", "16", "--max-num-batched-tokens", "256", *extra]


def kinds():
    """Request kinds: (messages for the server, messages and images for the offline reference, or a
    function of the request's index giving them: a fresh image no cache holds)."""
    imgs = [png(40, 70, seed=21), png(28, 28, seed=22), png(56, 42, seed=23), png(30, 90, seed=24)]
    out = [chat_kind(t, []) for t in ("hi", "tell me more about this " * 4, "short")]
    out += [chat_kind("look", [imgs[k] for k in pick]) for pick in ([0], [1], [2, 3])]
    out += [lambda i: chat_kind("new", [png(30 + i % 20, 40, seed=1000 + i)])] * 3
    return out


def chat_kind(text, images):
    parts = [{"type": "text", "text": text}] if images else text
    sent = parts + [{"type": "image_url", "image_url": {"url": data_uri(raw)}} for raw in images] if images else parts
    ref = parts + [{"type": "image"}] * len(images) if images else parts
    return [{"role": "user", "content": sent}], [{"role": "user", "content": ref}], images


@pytest.mark.slow
def test_120_requests_with_hang_ups_and_the_encode_worker_killed(tmp_path):
    ckpt = resolve_model("tiny-vl")
    ks = kinds()
    of = lambda k, i: ks[k](i) if callable(ks[k]) else ks[k]
    ep, pp, dp, rp = free_port_pair(), free_port_pair(), free_port_pair(), free_port()
    log = open(tmp_path / "deploy.log", "w+")
    procs = {"encode": start(worker_args(ckpt, "encode", ep), log),
             "prefill": start(worker_args(ckpt, "prefill", pp, "--transfer-timeout", "3"), log),
             "decode": start(worker_args(ckpt, "decode", dp, "--transfer-timeout", "10"), log)}
    procs["router"] = start(["router", "--encode", f"127.0.0.1:{ep}", "--prefill", f"127.0.0.1:{pp}", "--decode",
                             f"127.0.0.1:{dp}", "--model", str(ckpt), "--served-model-name", "vl", "--port", str(rp),
                             "--worker-timeout", "2"], log)
    base = f"http://127.0.0.1:{rp}"
    try:
        wait_ready(procs["router"], base, 120, log)
        rng = random.Random(1)
        plan = [(rng.randrange(len(ks)), rng.random() < 0.15) for _ in range(N_REQUESTS)]
        results, sent, lock = [None] * N_REQUESTS, [0], threading.Lock()
        phase = ["before"]

        def one(i):
            k, hang_up = plan[i]
            with lock:
                sent[0] += 1
            body = {"model": "vl", "messages": of(k, i)[0], "max_tokens": N_TOKENS, "temperature": 0, "ignore_eos": True,
                    "logprobs": True, "return_tokens_as_token_ids": True}
            at = phase[0]
            try:
                r = httpx.post(base + "/v1/chat/completions", json=body,
                               timeout=rng.uniform(0.02, 0.3) if hang_up else 60)
            except httpx.TimeoutException:
                results[i] = ("hung up", k, at)
                return
            except httpx.TransportError as e:
                results[i] = ("transport", str(e), at)
                return
            if r.status_code == 200:
                toks = [int(e["token"].removeprefix("token_id:")) for e in r.json()["choices"][0]["logprobs"]["content"]]
                results[i] = ("ok", (k, toks, i), at)
            else:
                err = r.json()
                assert err.get("object") == "error" and err.get("message"), err
                results[i] = (r.status_code, (k, err["message"]), at)

        down, back = threading.Event(), threading.Event()

        def chaos():           # kill the encode worker a third of the way in, a new one at two thirds
            while sent[0] < N_REQUESTS // 3:
                time.sleep(0.01)
            procs["encode"].send_signal(signal.SIGKILL)
            procs["encode"].wait()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and metric(base, "ouro:epd_encoders_up") != 0:
                time.sleep(0.05)
            phase[0] = "down"
            down.set()
            while sent[0] < 2 * N_REQUESTS // 3:
                time.sleep(0.01)
            procs["encode"] = start(worker_args(ckpt, "encode", ep), log)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and metric(base, "ouro:epd_encoders_up") != 1:
                time.sleep(0.1)
            phase[0] = "after"
            back.set()

        chaos_thread = threading.Thread(target=chaos)
        chaos_thread.start()

        def paced(i):            # each part runs once the router has seen the change before it
            if i >= N_REQUESTS // 3 + CONCURRENCY:
                down.wait(150)
            if i >= 2 * N_REQUESTS // 3 + CONCURRENCY:
                back.wait(150)
            one(i)
        with cf.ThreadPoolExecutor(CONCURRENCY) as pool:
            list(pool.map(paced, range(N_REQUESTS)))
        chaos_thread.join()
        assert health(base) == 200             # prefill and decode never went down

        refs = {}
        for kind, v, _ in results:
            if kind == "ok":
                key = v[0] if not callable(ks[v[0]]) else (v[0], v[2])
                if key not in refs:
                    _, msgs, images = of(v[0], v[2])
                    refs[key] = offline_tokens(msgs, images, N_TOKENS)
                assert v[1] == refs[key], (v, refs[key])
        assert not [r for r in results if r[0] == "transport"]
        has_images = lambda k: callable(ks[k]) or bool(ks[k][2])
        counts = {}
        for kind, v, at in results:
            counts[(kind, at)] = counts.get((kind, at), 0) + 1
        print("stress outcome:", counts, sorted({str(v[1])[:80] for kind, v, _ in results if isinstance(kind, int)}))
        down = [(kind, v[0]) for kind, v, at in results if at == "down" and kind != "hung up"]
        assert any(kind == 503 and has_images(k) for kind, k in down), down       # images refused while no encoder
        assert all(kind == "ok" for kind, k in down if not has_images(k)), down    # text served all along
        tail = [(kind, v) for kind, v, at in results[-N_REQUESTS // 6:] if kind != "hung up"]
        assert sum(kind == "ok" and has_images(v[0]) for kind, v in tail) >= 3, tail  # images again after the restart
        left = settled(base, ("ouro:kv_pages_used", "ouro:state_slots_used", "ouro:pd_decode_rooms",
                              "ouro:pd_prefill_pages_used", "ouro:pd_prefill_slots_used",
                              "ouro:pd_prefill_held_requests", "ouro:epd_image_waits", "ouro:num_requests_in_flight"))
        assert not any(left.values()), left
    finally:
        stop_all(procs.values(), 15)
        log.close()
