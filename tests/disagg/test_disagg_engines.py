"""A prefill engine and a decode engine joined by a real transfer (tcp and shm on 127.0.0.1):
greedy and seeded-sampled outputs equal one engine's token for token, for mixed prompt lengths
(short, mid-page, several chunks) arriving together; aborts on either side at any stage and a
room whose prefill never comes release every page and slot on both sides."""

import time

import pytest
import torch

from ouro.config import EngineConfig
from ouro.disagg.decode_engine import DecodeEngine, NoRoom
from ouro.disagg.prefill_engine import PrefillEngine
from ouro.engine.llm_engine import LLMEngine
from ouro.engine.sampling import SamplingParams
from ouro.models.loader import load_model

from ouro.lab.reference.checkpoint import make_hf_checkpoint
from tests.helpers.disagg_pair import KW, LENGTHS, full, pair, params, prompts, run_pair, single


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("disagg_engines")
    make_hf_checkpoint("tiny", d)
    return d


@pytest.mark.parametrize("backend,sampled", [("tcp", False), ("shm", False), ("tcp", True)])
def test_prefill_decode_pair_equals_one_engine(ckpt, backend, sampled):
    want = single(ckpt, sampled)
    p, d = pair(ckpt, backend)
    try:
        for i, ids in enumerate(prompts()):
            room = d.reserve(f"r{i}", ids, params(i, sampled))
            p.add(f"r{i}", ids, params(i, sampled), room)
        got = run_pair(p, d)
        assert got == want
        assert not d.failures and d.transfers == {"completed": len(LENGTHS), "failed": 0}
        assert full(p.engine) and full(d.engine) and not p.engine.scheduler.held
        assert set(p.outcomes.values()) == {"done"}
    finally:
        p.close()
        d.close()


def test_aborts_and_lost_prefills_release_both_sides(ckpt):
    p, d = pair(ckpt, timeout_s=1.0)
    try:
        ps = prompts()
        rooms = {f"r{i}": d.reserve(f"r{i}", ids, params(i, False)) for i, ids in enumerate(ps)}
        for i in (0, 1, 2):
            p.add(f"r{i}", ps[i], params(i, False), rooms[f"r{i}"])
        d.abort("r3")                        # aborted before any prefill worker saw it
        p.step()                             # r0..r2 start; r2's prefill takes several chunks
        p.abort("r2")                        # the prefill side gives up mid-prompt
        d.abort("r1")                        # the client goes away while r1 is in flight
        # r4 never reaches a prefill worker: its room times out
        got = run_pair(p, d, limit_s=20)
        assert set(got) == {"r0"} and len(got["r0"]) == 7
        failed = dict(d.failures)
        assert set(failed) == {"r2", "r4"}, failed         # r1 and r3 were the client's own aborts
        assert "timed out" in failed["r4"]
        assert full(p.engine) and full(d.engine) and not p.engine.scheduler.held and not d.reserved
    finally:
        p.close()
        d.close()


def test_a_full_decode_worker_says_so(ckpt):
    p, d = pair(ckpt)
    try:
        n = d.engine.slots.num_total
        for i in range(n):
            d.reserve(f"r{i}", [1, 2, 3], params(i, False))
        with pytest.raises(NoRoom, match="slot"):
            d.reserve("one-more", [1, 2, 3], params(0, False))
        with pytest.raises(ValueError, match="duplicate"):
            d.reserve("r0", [1, 2, 3], params(0, False))
        for i in range(n):
            d.abort(f"r{i}")
        d.step()
        assert full(d.engine)
    finally:
        p.close()
        d.close()


def test_a_prefix_the_decode_side_holds_is_not_sent_again(ckpt):
    """Decode-side prefix caching: the second request's room starts with the first's full pages,
    only the rest of its rows travel, and its tokens still equal one engine's."""
    g = torch.Generator().manual_seed(12)
    shared = torch.randint(1, 500, (70,), generator=g).tolist()
    ps = [shared + torch.randint(1, 500, (n,), generator=g).tolist() for n in (9, 30)]
    ref = LLMEngine(load_model(ckpt), None, EngineConfig(**KW), verbose=False)
    want = {}
    for i, p in enumerate(ps):
        ref.add_request({"prompt_token_ids": p}, params(i, False), f"r{i}")
        while ref.has_unfinished():
            for o in ref.step():
                want.setdefault(o.request_id, []).extend(o.new_token_ids)
    p_eng = PrefillEngine(LLMEngine(load_model(ckpt), None, EngineConfig(**KW), verbose=False))
    d = DecodeEngine(LLMEngine(load_model(ckpt), None, EngineConfig(**KW, enable_prefix_caching=True), verbose=False))
    try:
        got, sent = {}, []
        for i, p in enumerate(ps):
            room = d.reserve(f"r{i}", p, params(i, False))
            p_eng.add(f"r{i}", p, params(i, False), room)
            before = d.kv.receiver.bytes_received
            got.update(run_pair(p_eng, d))
            sent.append((room["skip_tokens"], d.kv.receiver.bytes_received - before))
        assert got == want
        assert sent[0][0] == 0 and sent[1][0] == 64                  # 4 full pages of 16 held
        assert sent[1][1] < sent[0][1]
        assert p_eng.engine.pages.num_free == p_eng.engine.pages.num_total and not d.reserved
        assert d.engine.slots.num_free == d.engine.slots.num_total
    finally:
        p_eng.close()
        d.close()


def test_the_worker_loop_sleeps_while_a_room_waits_and_wakes_on_its_event(ckpt, monkeypatch):
    """A decode worker whose room waits for its prefill sleeps in one poll on its messages and
    the rooms' events: it steps only at POLL_MS ticks (it woke every 2 ms before, taking CPU from
    the prefill beside it), and a room's event wakes it at once, not at the next tick."""
    import threading
    import zmq
    from ouro.disagg import worker as worker_mod
    from ouro.serve.messages import decode, encode, params_to_wire
    monkeypatch.setattr(worker_mod, "POLL_MS", 1000)       # ticks a second apart: a wake-up is an event's
    d = DecodeEngine(LLMEngine(load_model(ckpt), None, EngineConfig(**KW), verbose=False))
    steps, woken = [], threading.Event()
    real_step = d.step

    def counted():
        steps.append(time.monotonic())
        if not d.events.empty():
            woken.set()
        return real_step()
    d.step = counted
    ctx = zmq.Context()
    inbox, out_pull = ctx.socket(zmq.PULL), ctx.socket(zmq.PULL)
    port = inbox.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    outbox = ctx.socket(zmq.PUSH)
    out_port = outbox.bind_to_random_port("tcp://127.0.0.1")
    out_pull.connect(f"tcp://127.0.0.1:{out_port}")
    sender = worker_mod.OutputSender(outbox, encode, lambda o: o)
    loop = threading.Thread(target=worker_mod._loop, args=("decode", d, inbox, sender, decode, {"type": "ready"}, False))
    loop.start()
    try:
        push.send(encode({"type": "reserve", "rid": "r", "prompt_token_ids": prompts()[1],
                          "params": params_to_wire(SamplingParams(max_tokens=2))}))
        deadline = time.monotonic() + 10
        while "r" not in d.reserved and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "r" in d.reserved
        time.sleep(0.1)
        n0 = len(steps)
        time.sleep(1.5)
        assert len(steps) - n0 <= 3, len(steps) - n0          # a tick a second, not a 2 ms spin (750)
        t = time.monotonic()
        d.events.put(("ignored", type("R", (), {"rid": "nobody"})(), None))  # an event from a receiver thread
        assert woken.wait(5) and steps[-1] - t < 0.3, steps[-1] - t          # woken by it, not by a tick
    finally:
        push.send(encode({"type": "shutdown"}))
        loop.join(10)
        for s in (push, inbox, outbox, out_pull):
            s.close(0)
        ctx.term()
        d.abort("r")
        d.close()
    assert not loop.is_alive()
