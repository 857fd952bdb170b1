"""`ouro serve` processes under overload, engine death, SIGTERM and a killed frontend."""

import asyncio
import os
import signal
import time

import httpx
import pytest

from tests.helpers.serve_helpers import Server, idle, post

pytestmark = pytest.mark.processes


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    return tiny_checkpoint


@pytest.fixture(scope="module")
def small_server(model_dir, tmp_path_factory):
    """Two running + three queued requests at most; killed by the last test that uses it. Each token
    takes at least 20 ms (paced), so the five admitted requests of 64 tokens hold their places for
    seconds on any machine while the overload test sends the rest."""
    s = Server(model_dir, "--max-num-seqs", "2", "--max-queued-requests", "3",
               "--logits-processors", "tests.helpers.paced_steps:PacedSteps",
               tmp_path=tmp_path_factory.mktemp("serve_small"))
    yield s
    s.stop()


def test_overload_gets_429_quickly_while_admitted_requests_complete(small_server):
    s = small_server

    async def one(c, i):
        t = time.monotonic()
        r = await c.post(s.base + "/v1/completions",
                         json={"prompt": f"load {i}", "max_tokens": 64, "temperature": 0, "ignore_eos": True})
        return r.status_code, time.monotonic() - t, r.json()

    async def run():
        async with httpx.AsyncClient(timeout=300) as c:
            first = [asyncio.ensure_future(one(c, i)) for i in range(5)]
            for _ in range(100):                  # until the five have their places
                if await asyncio.to_thread(s.metric, "ouro:num_requests_in_flight") == 5:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the five admitted requests never showed as in flight")
            rest = await asyncio.gather(*[one(c, i) for i in range(5, 25)])
            return await asyncio.gather(*first), rest
    admitted, refused = asyncio.run(run())
    assert [r[0] for r in admitted] == [200] * 5
    assert all(r[2]["usage"]["completion_tokens"] == 64 for r in admitted)
    assert [r[0] for r in refused] == [429] * 20 and refused[0][2]["type"] == "RateLimitError"
    assert max(r[1] for r in refused) < min(r[1] for r in admitted)   # refused at once, not queued
    assert s.metric("ouro:request_rejected_total") >= 20
    assert idle(s)


def test_engine_killed_mid_load_gives_errors_not_hangs(small_server):
    s = small_server

    async def one(c, i):
        r = await c.post(s.base + "/v1/completions", json={"prompt": f"x {i}", "max_tokens": 400,
                                                           "temperature": 0, "ignore_eos": True})
        return r.status_code

    async def run():
        async with httpx.AsyncClient(timeout=60) as c:
            tasks = [asyncio.ensure_future(one(c, i)) for i in range(4)]
            await asyncio.sleep(1.5)
            os.kill(s.engine_pid, signal.SIGKILL)
            return await asyncio.gather(*tasks)
    t = time.monotonic()
    codes = asyncio.run(run())
    assert time.monotonic() - t < 30 and codes == [503] * 4
    assert httpx.get(s.base + "/health").status_code == 503
    assert post(s, "/v1/completions", {"prompt": "hi"}, key=None).status_code == 503
    assert s.proc.poll() is None                     # the frontend itself stays up and answers


@pytest.mark.slow
def test_sigterm_during_load_drains_and_exits_in_time(model_dir, tmp_path):
    s = Server(model_dir, "--shutdown-timeout", "3", "--logits-processors", "tests.helpers.paced_steps:PacedSteps",
               tmp_path=tmp_path)                   # paced: the long ones cannot finish in time on any machine

    async def one(c, i, tokens):
        try:
            r = await c.post(s.base + "/v1/completions", json={"prompt": f"x {i}", "max_tokens": tokens,
                                                               "temperature": 0, "ignore_eos": True})
            return r.status_code
        except httpx.HTTPError:
            return "closed"

    async def run():
        async with httpx.AsyncClient(timeout=60) as c:
            short = [asyncio.ensure_future(one(c, i, 8)) for i in range(3)]
            long = [asyncio.ensure_future(one(c, i, 3000)) for i in range(3, 6)]
            await asyncio.sleep(1.0)
            s.proc.send_signal(signal.SIGTERM)
            t = time.monotonic()
            await asyncio.sleep(0.3)
            late = await one(c, 99, 4)
            return await asyncio.gather(*short), await asyncio.gather(*long), late, t
    short, long, late, t = asyncio.run(run())
    rc = s.proc.wait(timeout=20)
    assert time.monotonic() - t < 3 + 10 and rc == 0
    assert short == [200, 200, 200]                  # in flight and quick: they finished
    assert late in (503, "closed")                   # new work is refused while draining
    assert all(code != 200 for code in long)         # too long for the timeout: cut, not waited for
    assert not pid_alive(s.engine_pid)               # the engine went with it
    s.stop()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:             # a zombie waiting for its reaper is gone too
        return f.read().split(")")[-1].split()[0] != "Z"


def test_engine_exits_when_its_frontend_is_killed(model_dir, tmp_path):
    s = Server(model_dir, tmp_path=tmp_path)
    pid = s.engine_pid
    s.proc.kill()
    s.proc.wait(10)
    deadline = time.monotonic() + 10
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not pid_alive(pid), "an orphaned engine process would hold the model's memory forever"
    s.stop()
