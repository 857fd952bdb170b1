"""The prefill worker's transfer thread and the decode worker's rooms over real sockets on
127.0.0.1: layers queued from forward hooks as the prefill computes reach the room (tcp and shm)
and decode from there equals decode in place; every way a request can end (done, abort from either
side, a timeout before or after `go`, a prefill worker that vanishes) releases the prefill side's
pages and frees the decode side's room exactly once, and never while a write may still come."""

import threading
import time

import pytest
import torch

from ouro.disagg import shared_cache
from ouro.disagg.kv_receiver import KVReceiver
from ouro.disagg.kv_sender import KVSender
from ouro.disagg.rooms import RoomState
from ouro.layers.context import ForwardContext, ModelCache
from ouro.models.loader import load_model

from ouro.lab.reference.checkpoint import make_hf_checkpoint

PAGE, PROMPT = 8, 45
SRC_PAGES, SRC_SLOT = [3, 0, 5, 1, 4, 2], 1
DST_PAGES, DST_SLOT = [1, 4, 0, 5, 2, 3], 2


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("handshake_tiny")
    make_hf_checkpoint("tiny", d)
    return load_model(d)


class Side:
    """Events seen on one side, with a way to wait for them."""

    def __init__(self):
        self.events, self.cond = [], threading.Condition()

    def __call__(self, *event):
        with self.cond:
            self.events.append(event)
            self.cond.notify_all()

    def wait(self, n=1, timeout=20):
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.events) >= n, timeout), self.events
            return self.events


def caches(model):
    src, dst = (ModelCache(model.config, 3, 6, PAGE) for _ in range(2))
    dst.poison()
    return src, dst


def prefill(model, cache, prompt, tx, rid, chunks=((0, 20), (20, PROMPT))):
    """Chunked prefill; each layer, once computed, is queued to the transfer thread (overlap)."""
    def hook(i):
        def after(mod, args, out):
            ctx = args[1]
            t0 = ctx.start_pos[0]
            tx.layer_ready(rid, i, t0, t0 + ctx.query_lens[0], t0 + ctx.query_lens[0] == PROMPT)
        return after
    handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(model.layers)]
    try:
        with torch.inference_mode():
            for t0, t1 in chunks:
                ctx = ForwardContext.build(cache, [t1 - t0], [t0], [SRC_SLOT], torch.tensor([SRC_PAGES]))
                logits = model(torch.tensor(prompt[t0:t1]), ctx)
    finally:
        for h in handles:
            h.remove()
    return int(logits.argmax())


def decode(model, cache, pages, slot, tok, steps=3):     # positions 45..47: the last page
    out = []
    with torch.inference_mode():
        for i in range(steps):
            ctx = ForwardContext.build(cache, [1], [PROMPT + i], [slot], torch.tensor([pages]))
            lg = model(torch.tensor([tok]), ctx)
            out.append(lg)
            tok = int(lg.argmax())
    return torch.cat(out)


def setup(model, backend="tcp", timeout_s=20.0):
    src, dst = caches(model)
    spec = shared_cache.share(dst, f"hs-{time.monotonic_ns()}") if backend == "shm" else None
    d_side, p_side = Side(), Side()
    rx = KVReceiver(dst, model.config, d_side, backend=backend, shared_spec=spec)
    tx = KVSender(src, model.config, p_side)
    room = rx.rooms.reserve("r", DST_PAGES, DST_SLOT, PROMPT, 0, timeout_s)
    return src, dst, spec, rx, tx, room, d_side, p_side


def teardown(rx, tx, spec):
    tx.close()
    rx.close()
    if spec:
        shared_cache.unlink(spec)


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_layers_stream_into_the_room_and_decode_matches(model, backend):
    prompt = torch.randint(1, 300, (PROMPT,), generator=torch.Generator().manual_seed(4)).tolist()
    src, dst, spec, rx, tx, room, d_side, p_side = setup(model, backend)
    try:
        tx.open("r", rx.room_info(room), SRC_SLOT, SRC_PAGES)
        first = prefill(model, src, prompt, tx, "r")
        tx.finish("r", {"first_token": first})
        assert d_side.wait() == [("ready", d_side.events[0][1], None)]
        assert p_side.wait() == [("r", "done")]
        got = rx.rooms.take("r")
        assert got.result["first_token"] == first
        assert torch.equal(decode(model, dst, DST_PAGES, DST_SLOT, first), decode(model, src, SRC_PAGES, SRC_SLOT, first))
        assert tx.bytes_sent > 0 and not rx.errors
    finally:
        teardown(rx, tx, spec)


def test_decode_side_abort_after_go_waits_for_the_writers_answer(model):
    src, dst, spec, rx, tx, room, d_side, p_side = setup(model)
    try:
        tx.open("r", rx.room_info(room), SRC_SLOT, SRC_PAGES)
        deadline = time.monotonic() + 10
        while room.state is not RoomState.RECEIVING and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rx.rooms.abort("r") == "asked"
        assert p_side.wait() == [("r", "aborted by the decode worker")]
        assert [e[0] for e in d_side.wait()] == ["free"] and "r" not in rx.rooms.rooms
    finally:
        teardown(rx, tx, spec)


@pytest.mark.parametrize("backend", ["tcp", "shm"])      # over shm only the writer's own rule keeps the pages clean
def test_a_room_that_timed_out_before_go_refuses_the_late_writer(model, backend):
    src, dst, spec, rx, tx, room, d_side, p_side = setup(model, backend, timeout_s=0.0)
    try:
        assert rx.rooms.expire() == ["r"] and d_side.events[0][0] == "free"
        tx.open("r", rx.room_info(room), SRC_SLOT, SRC_PAGES)
        for layer in range(model.config.num_hidden_layers):
            tx.layer_ready("r", layer, 0, PROMPT, True)
        assert p_side.wait()[0][1].startswith("refused")
        assert torch.isnan(dst.recurrent[:, DST_SLOT]).all() and torch.isnan(dst.latent[:, DST_PAGES]).all()
    finally:
        teardown(rx, tx, spec)


def test_a_prefill_side_abort_releases_both_sides(model):
    src, dst, spec, rx, tx, room, d_side, p_side = setup(model)
    try:
        tx.open("r", rx.room_info(room), SRC_SLOT, SRC_PAGES)
        tx.abort("r")
        assert p_side.wait()[0][0] == "r"
        assert [e[0] for e in d_side.wait()] == ["free"]
        time.sleep(0.2)
        assert len(p_side.events) == 1 and len(d_side.events) == 1 and len(rx.rooms) == 0    # exactly once
    finally:
        teardown(rx, tx, spec)


def test_a_vanished_prefill_worker_frees_its_room(model):
    prompt = torch.randint(1, 300, (PROMPT,), generator=torch.Generator().manual_seed(5)).tolist()
    src, dst, spec, rx, tx, room, d_side, p_side = setup(model)
    try:
        tx.open("r", rx.room_info(room), SRC_SLOT, SRC_PAGES)
        prefill(model, src, prompt, tx, "r", chunks=((0, 20),))      # half the prompt, then gone
        time.sleep(0.3)
        tx.close()
        events = d_side.wait()
        assert events[0][0] == "free" and "connection closed" in events[0][2]
    finally:
        teardown(rx, tx, spec)


def test_a_decode_worker_that_never_answers_is_given_up_on_the_prefill_side(model):
    """No `go` ever comes: the prefill side writes nothing and releases the request after its
    timeout (a later `go` would be answered `aborted`)."""
    import socket
    silent = socket.create_server(("127.0.0.1", 0))
    conns = []
    threading.Thread(target=lambda: conns.append(silent.accept()), daemon=True).start()
    src, _ = caches(model)
    p_side = Side()
    tx = KVSender(src, model.config, p_side, timeout_s=0.5)
    try:
        room = {"address": "127.0.0.1:{}".format(silent.getsockname()[1]), "backend": "tcp", "pages": DST_PAGES,
                "slot": DST_SLOT, "skip_tokens": 0, "prompt_len": PROMPT}
        tx.open("r", room, SRC_SLOT, SRC_PAGES)
        tx.layer_ready("r", 3, 0, PROMPT, True)
        t = time.monotonic()
        (rid, outcome), = p_side.wait(timeout=10)
        assert rid == "r" and outcome.startswith("no answer from the decode worker")
        assert 0.4 < time.monotonic() - t < 5
    finally:
        tx.close()
        silent.close()
