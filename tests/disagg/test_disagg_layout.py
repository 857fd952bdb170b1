"""Two workers whose caches keep rows otherwise (different --dtype, or `auto` resolved differently on
two machines: bfloat16 where AVX-512 BF16 makes it fast, float32 elsewhere) cannot hand a request
over. The prefill side refuses it at once, naming what differs; a frame that breaks the protocol
anyway says why in the decode side's reason, not only that the connection closed."""

from __future__ import annotations

import time

import pytest
import torch

from ouro.config import EngineConfig
from ouro.disagg.decode_engine import DecodeEngine
from ouro.disagg.kv_receiver import KVReceiver
from ouro.disagg.kv_sender import KVSender
from ouro.disagg.prefill_engine import PrefillEngine
from ouro.disagg.state_pieces import LayoutMismatch, cache_layout, check_layout
from ouro.engine.llm_engine import LLMEngine
from ouro.layers.context import ModelCache
from ouro.lab.reference.checkpoint import make_hf_checkpoint
from ouro.models.loader import load_model
from tests.helpers.disagg_pair import KW, full, params, prompts, run_pair

PAGE = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("disagg_layout")
    make_hf_checkpoint("tiny", d)
    return d


def test_the_layout_names_each_tensor_dtype_and_width(ckpt):
    config = load_model(ckpt).config
    f32, bf16 = ModelCache(config, 2, 4, PAGE), ModelCache(config, 2, 4, PAGE, dtype=torch.bfloat16)
    a, b = cache_layout(f32), cache_layout(bf16)
    assert a["page_size"] == PAGE and a["latent"][0][0] == "float32" and b["latent"][0][0] == "bfloat16"
    check_layout(f32, {"layout": cache_layout(ModelCache(config, 5, 9, PAGE))})   # sizes may differ, rows may not
    check_layout(f32, {})                                 # a room that does not say: checked frame by frame
    with pytest.raises(LayoutMismatch, match=r"float32 rows of \d+ here, bfloat16 rows of \d+ on the decode worker.*--dtype"):
        check_layout(f32, {"layout": b})
    with pytest.raises(LayoutMismatch, match="page_size: 8 here, 16"):
        check_layout(f32, {"layout": cache_layout(ModelCache(config, 2, 4, 2 * PAGE))})


def test_a_prefill_worker_refuses_a_room_it_cannot_fill_and_nothing_leaks(ckpt):
    p = PrefillEngine(LLMEngine(load_model(ckpt), None, EngineConfig(**KW), verbose=False))
    d = DecodeEngine(LLMEngine(load_model(ckpt, dtype=torch.bfloat16), None, EngineConfig(**{**KW, "dtype": "bfloat16"}),
                               verbose=False), "tcp", timeout_s=30.0)
    try:
        ids = prompts()[1]
        room = d.reserve("r", ids, params(0, False))
        with pytest.raises(LayoutMismatch, match=r"latent: float32 rows of \d+ here, bfloat16 rows"):
            p.add("r", ids, params(0, False), room)
        assert not p.engine.has_unfinished() and full(p.engine)
        d.abort("r")                     # the router aborts the room when the prefill side says no
        run_pair(p, d, limit_s=5)
        assert full(d.engine)
    finally:
        p.close()
        d.close()


def test_a_frame_that_breaks_the_protocol_is_named_in_the_rooms_reason(ckpt):
    """A writer that ignores the layout (an older prefill worker): its first block does not fit the
    room, the connection breaks, and the room's reason says which block and by how much."""
    model = load_model(ckpt)
    config = model.config
    src, dst = ModelCache(config, 2, 6, PAGE, dtype=torch.bfloat16), ModelCache(config, 3, 6, PAGE)
    events = []
    rx = KVReceiver(dst, config, lambda *e: events.append(e))
    tx = KVSender(src, config, lambda *e: None)
    try:
        room = rx.rooms.reserve("r", [0, 1], 1, 2 * PAGE, 0, 20.0)
        info = {k: v for k, v in rx.room_info(room).items() if k != "layout"}
        tx.open("r", info, 0, [2, 3])
        dsa = config.dsa_layers[0]
        tx.layer_ready("r", dsa, 0, 2 * PAGE, True)
        t = time.monotonic()
        while not events and time.monotonic() - t < 10:
            time.sleep(0.02)
        (kind, _, reason), = events
        assert kind == "free" and "connection closed" in reason and "bytes, its destination" in reason, reason
    finally:
        tx.close()
        rx.close()
