"""Moving a request's cache from a prefill cache to a decode cache, layer by layer, over real
sockets on 127.0.0.1 (tcp) and through shared-memory files (shm): decode from the moved state
gives the same logits as decode where the prompt was prefilled, for a prompt cut mid-page and
mid-pool, prefilled in two chunks, onto other pages and another slot of a NaN-poisoned cache; with
the decode side already holding the first pages (a prefix hit there), only the rest moves. A
transfer that leaves out the KDA states, or frames that do not fit their room, fail loudly."""

import threading

import pytest
import torch

from ouro.disagg import shared_cache
from ouro.disagg.state_pieces import block_bytes, gather, layer_pieces, page_segments, pools_completed
from ouro.disagg.transfer import Receiver, Sender, TransferError
from ouro.layers.context import ForwardContext, ModelCache
from ouro.models.loader import load_model

from ouro.lab.reference.checkpoint import make_hf_checkpoint
from tests.helpers.numerics import rel_rms

PAGE = 8
PROMPT = 53                       # mid-page, mid-pool (kpool 4 on tiny)
CHUNKS = [(0, 29), (29, PROMPT)]
SRC_PAGES, SRC_SLOT = [5, 1, 6, 0, 3, 7, 2, 4], 2
DST_PAGES, DST_SLOT = [2, 7, 0, 4, 6, 1, 3, 5], 0
STEPS = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("disagg_tiny")
    make_hf_checkpoint("tiny", d)
    return load_model(d)


def new_cache(model):
    cache = ModelCache(model.config, 3, 8, PAGE)
    cache.poison()
    return cache


def run(model, cache, ids, start, pages, slot):
    ctx = ForwardContext.build(cache, [len(ids)], [start], [slot], torch.tensor([pages]))
    return model(torch.tensor(ids), ctx)


def decode_logits(model, cache, pages, slot, first_token):
    out, tok = [], first_token
    for i in range(STEPS):
        lg = run(model, cache, [tok], PROMPT + i, pages, slot)
        out.append(lg)
        tok = int(lg.argmax())
    return torch.cat(out)


class Room:
    """The decode side of one request, as the receiver's callbacks see it."""

    def __init__(self, cache, pages, slot):
        self.cache, self.pages, self.slot = cache, pages, slot
        self.frames, self.errors, self.done = [], [], threading.Event()

    def resolve(self, h, peer):
        lp = layer_pieces(self.cache_config)[h["layer"]]
        return page_segments(self.cache, lp, self.pages, self.slot, h["t0"], h["t1"], h["final"])

    def on_frame(self, h, peer):
        self.frames.append(h)
        if h.get("type") == "done":
            self.done.set()

    def on_error(self, peer, msg):
        self.errors.append(msg)
        self.done.set()


def transfer(model, prompt, backend, skip_tokens=0, send_states=True, dst=None):
    """Prefill on a source cache in two chunks, each layer's blocks sent after the chunk; returns
    (source cache, destination cache, room)."""
    src = new_cache(model)
    dst = dst if dst is not None else new_cache(model)
    spec = shared_cache.share(dst, f"test-{backend}-{id(dst)}") if backend == "shm" else None
    room = Room(dst, DST_PAGES, DST_SLOT)
    room.cache_config = model.config
    rx = Receiver(room.resolve, room.on_frame, room.on_error)
    remote = shared_cache.attach(spec) if spec else None
    tx = Sender(rx.address, backend)
    try:
        with torch.inference_mode():
            for t0, t1 in CHUNKS:
                run(model, src, prompt[t0:t1], t0, SRC_PAGES, SRC_SLOT)
                lo, final = max(t0, skip_tokens), t1 == PROMPT
                for lp in layer_pieces(model.config):
                    blocks = gather(src, lp, SRC_PAGES, SRC_SLOT, lo, t1, final and send_states)
                    if not blocks:
                        continue
                    h = {"type": "kv", "rid": "r", "layer": lp.layer, "t0": lo, "t1": t1, "final": final and send_states}
                    views = page_segments(remote, lp, DST_PAGES, DST_SLOT, lo, t1, h["final"]) if remote else None
                    tx.put(h, blocks, views)
            tx.notify({"type": "done", "rid": "r"})
        assert room.done.wait(30), "no done frame"
    finally:
        tx.close()
        rx.close()
        if spec:
            shared_cache.unlink(spec)
    assert not room.errors, room.errors
    return src, dst, room, tx, rx


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_decode_from_moved_state_equals_decode_in_place(model, backend):
    prompt = torch.randint(1, 300, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    src, dst, room, tx, rx = transfer(model, prompt, backend)
    with torch.inference_mode():
        first = int(run(model, new_cache(model), prompt, 0, SRC_PAGES, SRC_SLOT).argmax())
        want = decode_logits(model, src, SRC_PAGES, SRC_SLOT, first)
        got = decode_logits(model, dst, DST_PAGES, DST_SLOT, first)
    assert not got.isnan().any()
    assert torch.equal(got, want)
    kv = [f for f in room.frames if f["type"] == "kv"]
    assert [f["layer"] for f in kv if f["final"]] == list(range(model.config.num_hidden_layers))   # model order
    if backend == "tcp":
        assert rx.bytes_received == tx.bytes_sent == sum(sum(f["sizes"]) for f in kv) > 0


def test_with_a_prefix_on_the_decode_side_only_the_rest_moves(model):
    prompt = torch.randint(1, 300, (PROMPT,), generator=torch.Generator().manual_seed(2)).tolist()
    held = 3 * PAGE                                   # the decode side holds pages 0..2 of this prompt
    dst = new_cache(model)
    with torch.inference_mode():
        run(model, dst, prompt[:held], 0, DST_PAGES, 1)       # its own prefill of the prefix, another slot
        own = dst.latent[:, DST_PAGES[:3]].clone()
        src, dst, room, tx, rx = transfer(model, prompt, "tcp", skip_tokens=held, dst=dst)
        first = int(run(model, new_cache(model), prompt, 0, SRC_PAGES, SRC_SLOT).argmax())
        want = decode_logits(model, src, SRC_PAGES, SRC_SLOT, first)
        got = decode_logits(model, dst, DST_PAGES, DST_SLOT, first)
    assert rel_rms(got, want) < 1e-5         # its prefix rows were computed in another chunk: rounding only
    assert torch.equal(dst.latent[:, DST_PAGES[:3]], own)          # the held pages were not written
    assert min(f["t0"] for f in room.frames if f["type"] == "kv") == held


def test_leaving_out_the_kda_states_is_caught_by_the_reference(model):
    """The failure other stacks shipped: only the attention cache moved (a zeroed or stale KDA
    state still decodes fluently). Here the slot keeps its NaN poison and the logits show it."""
    prompt = torch.randint(1, 300, (PROMPT,), generator=torch.Generator().manual_seed(3)).tolist()
    src, dst, *_ = transfer(model, prompt, "tcp", send_states=False)
    with torch.inference_mode():
        got = decode_logits(model, dst, DST_PAGES, DST_SLOT, 7)
        want = decode_logits(model, src, SRC_PAGES, SRC_SLOT, 7)
    assert got.isnan().any() or not torch.allclose(got, want)


def test_pieces_cover_rows_pools_and_states_once(model):
    cache = new_cache(model)
    kpool = model.config.index_kpool
    assert list(pools_completed(0, 8, 4)) == [0, 1] and list(pools_completed(5, 12, 4)) == [1, 2]
    assert list(pools_completed(3, 4, 4)) == [0] and list(pools_completed(4, 7, 4)) == []
    total = 0
    for t0, t1 in CHUNKS:
        for lp in layer_pieces(model.config):
            blocks = gather(cache, lp, SRC_PAGES, SRC_SLOT, t0, t1, t1 == PROMPT)
            segs = page_segments(cache, lp, DST_PAGES, DST_SLOT, t0, t1, t1 == PROMPT)
            assert [b.numel() for b in blocks] == [sum(v.numel() for v in s) for s in segs]
            total += block_bytes(blocks)
    c = model.config
    e = cache.latent.element_size()
    rows = PROMPT * e * (len(c.dsa_layers) * c.kv_lora_rank + 2 * len(c.indexer_layers) * c.index_head_dim)
    pools = (PROMPT // kpool) * 4 * len(c.indexer_layers) * c.index_head_dim
    assert total == rows + pools + ModelCache.bytes_per_slot(c)


def test_a_frame_that_does_not_fit_its_room_is_an_error(model):
    cache = new_cache(model)
    lp = next(p for p in layer_pieces(model.config) if p.kind == "dsa")
    errors, got = [], threading.Event()
    rx = Receiver(lambda h, peer: page_segments(cache, lp, DST_PAGES, DST_SLOT, 0, 8, False), lambda h, peer: None,
                  lambda peer, msg: (errors.append(msg), got.set()))
    tx = Sender(rx.address)
    try:
        wrong = gather(cache, lp, SRC_PAGES, SRC_SLOT, 0, 9, False)     # one row too many
        try:
            tx.put({"type": "kv", "layer": lp.layer}, wrong)
        except OSError:
            pass                     # the receiver may hang up before the last block is sent
        assert got.wait(10)
    finally:
        tx.close()
        rx.close()
    assert "destination" in errors[0]
    with pytest.raises(ValueError, match="backend"):
        Sender(rx.address, "carrier-pigeon")
    with pytest.raises(TransferError, match="contiguous"):
        from ouro.disagg.transfer import as_bytes
        as_bytes(torch.zeros(4, 4).t())
