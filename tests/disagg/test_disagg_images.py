"""The encode role in process, over real sockets: an encode worker's image rows reach a prefill
worker's encoder cache keyed by image hash, the prefill worker sends them on with the state, and
the decode worker's tokens equal one engine's with the same images, also after the decode side
preempts the request and recomputes it from those rows. Two different images behind the same
text never share the decode side's cache pages. A miss asks again and then fails the request,
never the worker; rows of the wrong shape break only their connection."""

import time

import pytest
import torch

from ouro.config import EngineConfig, ModelConfig
from ouro.disagg.command import parse_layout
from ouro.disagg.decode_engine import DecodeEngine
from ouro.disagg.encode_worker import EncodeWorker
from ouro.disagg.encoder_cache import EmbedsReceiver, EncoderCache, ImageWaits
from ouro.disagg.prefill_engine import PrefillEngine
from ouro.disagg.rooms import RoomTable
from ouro.disagg.transfer import Sender
from ouro.engine.llm_engine import LLMEngine
from ouro.engine.multimodal import ImagePrompt, bytes_hash
from ouro.engine.sampling import SamplingParams
from ouro.models.image_processor import load_image
from ouro.models.loader import load_model
from ouro.models.resolve import resolve_model
from ouro.serve.messages import images_to_wire

from tests.helpers.image_helpers import png

KW = dict(max_memory=48 << 20, page_size=16, dtype="float32", max_num_batched_tokens=64)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def vl():
    d = resolve_model("tiny-vl")
    return d, ModelConfig.from_hf(d)


def prompt(vl, images, text=(7, 8, 9)):
    """20 text tokens, then one placeholder per image (with text between), expanded."""
    d, c = vl
    ids = list(range(30, 50))
    for _ in images:
        ids += [c.image_start_token_id, c.image_token_id, c.image_end_token_id, *text]
    return ImagePrompt(d, c).expand(ids, [load_image(r) for r in images])


def single(vl, ids, images):
    d, _ = vl
    e = LLMEngine(load_model(d), None, EngineConfig(**KW), verbose=False, model_dir=d)
    e.add_request({"prompt_token_ids": ids, "multi_modal_data": {"image": images}}, GREEDY, "ref")
    out = []
    while e.has_unfinished():
        for o in e.step():
            out += o.new_token_ids
    return out


def trio(vl, prefix_decode=False, timeout_s=30.0):
    d, _ = vl
    enc = EncodeWorker(str(d))
    p = PrefillEngine(LLMEngine(load_model(d), None, EngineConfig(**KW), verbose=False, model_dir=d), timeout_s,
                      images=True)
    dec = DecodeEngine(LLMEngine(load_model(d), None, EngineConfig(**KW, enable_prefix_caching=prefix_decode),
                                 verbose=False, model_dir=d), timeout_s=timeout_s)
    return enc, p, dec


def run(p, dec, until=lambda: False, limit_s=60):
    out, t = {}, time.monotonic()
    while (p.has_work() or dec.has_work()) and time.monotonic() - t < limit_s and not until():
        p.step()
        for o in dec.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        time.sleep(0.001)
    return out


def through(enc, p, dec, rid, ids, images, encode=True):
    hashes = [bytes_hash(r) for r in images]
    if encode:
        answer = enc.encode({"rid": rid, "job": 0, "images": images_to_wire(images), "hashes": hashes,
                             "to": p.embeds.address})
        assert answer["type"] == "encoded", answer
    room = dec.reserve(rid, ids, GREEDY, hashes)
    p.add(rid, ids, GREEDY, room, {"hashes": hashes, "coming": hashes if encode else []})
    return room


def full(engine):
    return engine.pages.num_free == engine.pages.num_total and engine.slots.num_free == engine.slots.num_total


def test_encode_prefill_decode_equals_one_engine_also_after_a_decode_preemption(vl):
    images = [png(40, 70, seed=1), png(50, 60, seed=2)]
    ids = prompt(vl, images)
    want = single(vl, ids, images)
    enc, p, dec = trio(vl)
    try:
        through(enc, p, dec, "a", ids, images)
        got = run(p, dec, until=lambda: "a" in dec.engine.requests)
        req = dec.engine.requests["a"]
        rows, _ = enc.encoder.encode_images([load_image(r) for r in images])
        assert torch.equal(req.mm.embeds, torch.cat(rows))          # every row arrived, none left NaN
        dec.engine.scheduler.preempt(req)                           # recompute the prompt from those rows
        for k, v in run(p, dec).items():
            got.setdefault(k, []).extend(v)
        assert got["a"] == want and req.num_preemptions == 1
        assert full(p.engine) and full(dec.engine) and not dec.failures
        assert p.waits.cache.stats()["encoder_cache_entries"] == 2
    finally:
        for x in (enc, p, dec):
            x.close()


def test_different_images_behind_the_same_text_never_share_decode_pages(vl):
    a, b = png(40, 70, seed=3), png(40, 70, seed=4)
    ids = prompt(vl, [a])
    assert ids == prompt(vl, [b])                          # the same tokens: only the key tells them apart
    want_a, want_b = single(vl, ids, [a]), single(vl, ids, [b])
    assert want_a != want_b
    enc, p, dec = trio(vl, prefix_decode=True)
    try:
        first = ids.index(vl[1].image_token_id)
        rooms, got = {}, {}
        for rid, image in (("a", a), ("b", b), ("a2", a)):
            rooms[rid] = through(enc, p, dec, rid, ids, [image], encode=rid != "a2")   # a2: rows from the cache
            got.update(run(p, dec))
        assert rooms["b"]["skip_tokens"] <= first < rooms["a2"]["skip_tokens"]
        assert got == {"a": want_a, "b": want_b, "a2": want_a}
        assert p.waits.cache.hits >= 1
    finally:
        for x in (enc, p, dec):
            x.close()


def test_without_an_encode_worker_the_prefill_worker_encodes(vl):
    images = [png(30, 30, seed=6)]
    ids = prompt(vl, images)
    want = single(vl, ids, images)
    _, p, dec = trio(vl)
    try:
        hashes = [bytes_hash(images[0])]
        room = dec.reserve("x", ids, GREEDY, hashes)
        p.add("x", ids, GREEDY, room, {"hashes": hashes, "data": images_to_wire(images)})
        assert run(p, dec)["x"] == want
    finally:
        p.close()
        dec.close()


def test_a_miss_asks_again_then_fails_the_request_not_the_worker(vl):
    images = [png(40, 40, seed=7)]
    ids = prompt(vl, images)
    enc, p, dec = trio(vl, timeout_s=0.2)
    try:
        h = bytes_hash(images[0])
        room = dec.reserve("lost", ids, GREEDY, [h])
        p.add("lost", ids, GREEDY, room, {"hashes": [h], "coming": []})
        assert p.asks == [("lost", [h])]                     # not cached, not coming: asked at once
        p.asks.clear()
        t = time.monotonic()
        while not p.failures and time.monotonic() - t < 10:
            p.step()
            time.sleep(0.02)
        assert [a[0] for a in p.asks] == ["lost", "lost"]    # asked again after each wait
        assert p.failures and p.failures[0][0] == "lost" and p.failures[0][2] == 503
        assert not p.waits.waiting and "lost" not in p.engine.requests
        dec.abort("lost")
        run(p, dec)
        # the worker serves on: the next request's rows arrive and it completes
        want = single(vl, ids, images)
        through(enc, p, dec, "next", ids, images)
        assert run(p, dec)["next"] == want
        assert full(p.engine) and full(dec.engine)
    finally:
        for x in (enc, p, dec):
            x.close()


def test_encoder_cache_keeps_the_recent_within_its_bytes():
    c = EncoderCache(3 * 40)                          # three rows of 10 float32
    rows = {k: torch.full((1, 10), float(i)) for i, k in enumerate("abcd")}
    for k in "abc":
        c.put(k, rows[k])
    assert c.get("a") is rows["a"]                    # a is now the most recent
    c.put("d", rows["d"])                             # b goes
    assert c.get("b") is None and c.get("c") is rows["c"] and c.bytes == 120
    c.put("big", torch.zeros(4, 10))                  # larger than the whole cache: not kept
    assert c.get("big") is None and (c.hits, c.misses) == (2, 2)


def test_a_wait_keeps_what_it_found_and_asks_only_for_what_is_not_coming():
    now = [0.0]
    c = EncoderCache(1 << 20)
    c.put("A", torch.ones(2, 4))
    w = ImageWaits(c, wait_s=1.0, max_asks=2, clock=lambda: now[0])
    wait, ask = w.add("r", ("req",), ["A", "B", "C"], coming=["B"])
    assert ask == ["C"] and wait.missing() == ["B", "C"]
    c.rows.clear()                                    # evicted while it waits: the wait still has it
    assert w.arrived("B", torch.zeros(1, 4)) == []
    now[0] = 1.5
    again, failed = w.overdue()
    assert [x.rid for x in again] == ["r"] and again[0].missing() == ["C"] and not failed
    now[0] = 3.0
    again, failed = w.overdue()
    assert not again and [x.rid for x in failed] == ["r"] and not w.waiting
    wait, _ = w.add("s", ("req",), ["B", "C"])
    assert w.arrived("C", torch.zeros(1, 4)) == [wait] and set(wait.got) == {"B", "C"}


def test_rows_that_come_before_their_request_are_held_for_it_even_by_an_empty_cache():
    now = [0.0]
    w = ImageWaits(EncoderCache(0), wait_s=1.0, clock=lambda: now[0])
    rows = torch.ones(2, 4)
    assert w.arrived("A", rows) == [] and w.cache.get("A") is None      # the cache keeps nothing
    wait, ask = w.add("r", ("req",), ["A"], coming=["A"])
    assert not ask and not wait.missing() and wait.got["A"] is rows and not w.fresh
    wait, ask = w.add("s", ("req",), ["A"])           # claimed once: the next request misses
    assert ask == ["A"]
    w.arrived("B", rows)                              # never claimed: dropped after wait_s
    now[0] = 2.0
    w.overdue()
    assert not w.fresh


def test_rows_of_the_wrong_shape_break_only_their_connection():
    got = []
    r = EmbedsReceiver(8, lambda h, rows: got.append((h, rows)))
    try:
        good = torch.randn(3, 8)
        s = Sender(r.address)
        s.send_inline({"type": "embeds", "hash": "h1", "shape": [3, 8], "dtype": "float32"}, [good])
        bad = Sender(r.address)
        bad.send_inline({"type": "embeds", "hash": "h2", "shape": [3, 9], "dtype": "float32"}, [torch.randn(3, 9)])
        s.send_inline({"type": "embeds", "hash": "h3", "shape": [1, 8], "dtype": "float32"}, [good[:1]])
        t = time.monotonic()
        while (len(got) < 2 or not r.errors) and time.monotonic() - t < 5:
            time.sleep(0.01)
        assert [h for h, _ in got] == ["h1", "h3"] and torch.equal(got[0][1], good)
        assert len(r.errors) == 1 and "float32" in r.errors[0]
        s.close()
        bad.close()
    finally:
        r.close()


def test_a_room_awaiting_image_rows_is_not_complete_without_them():
    events = []
    t = RoomTable([0], [1], lambda *e: events.append(e))
    conn = object()
    t.reserve("r", [0], 0, 4, 0, 30.0, image_rows=torch.zeros(2, 4))
    assert t.hello("r", conn)
    t.received("r", conn, 0, 0, 4, True)
    t.received("r", conn, 1, 0, 4, True)
    t.finished("r", conn, "done", {})
    assert events[-1][0] == "free" and "no image rows" in events[-1][2]


@pytest.mark.parametrize("text, want", [("1E1P1D", (1, 1, 1)), ("1p2d", (0, 1, 2)), ("2E1P1D", (2, 1, 1))])
def test_layouts(text, want):
    assert parse_layout(text) == want


@pytest.mark.parametrize("text", ["0E1P1D", "E1P1D", "1E1P", "1D1P"])
def test_bad_layouts_say_the_form(text):
    with pytest.raises(ValueError, match=r"\[XE\]YPZD"):
        parse_layout(text)
