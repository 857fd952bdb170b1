"""A burst of requests reaching an idle engine is prefilled as one step (`engine_process._loop`: the
loop waits up to GATHER_GAP_MS for the burst's next request, at most OURO_IDLE_GATHER_MS in all).
Stepping at once prefilled a burst's first request alone while the frontend forwarded the rest, and
they all waited for that step too. The engine process's own loop, a real engine and real ZeroMQ
sockets, the requests pushed 1 ms apart as the frontend forwards a burst."""

import threading
import time

import pytest
import zmq

from ouro.config import EngineConfig
from ouro.engine.llm_engine import LLMEngine
from ouro.engine.sampling import SamplingParams
from ouro.models.loader import load_model
from ouro.serve import engine_process
from ouro.serve.messages import decode, encode, output_to_wire, params_from_wire, params_to_wire

BURST = 4


def _first_step_sizes(checkpoint, gather_s: float, spacing_s: float) -> list[int]:
    """The requests each engine step held while the loop served a burst of BURST pushed `spacing_s` apart."""
    engine = LLMEngine(load_model(checkpoint), None, EngineConfig(max_memory=32 << 20, page_size=16), verbose=False)
    sizes = []
    step = engine.step

    def counted():
        sizes.append(len(engine.scheduler.running) + len(engine.scheduler.waiting))
        return step()
    engine.step = counted
    ctx = zmq.Context()
    inbox, feed = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    outbox, drain = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    inbox.bind("inproc://in"), feed.connect("inproc://in")
    drain.bind("inproc://out"), outbox.connect("inproc://out")
    sender = engine_process.OutputSender(outbox, encode, output_to_wire)
    loop = threading.Thread(target=engine_process._loop,
                            args=(engine, inbox, sender, decode, params_from_wire, gather_s), daemon=True)
    loop.start()
    time.sleep(0.3)                            # idle: the loop waits on its inbox
    params = params_to_wire(SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    for i in range(BURST):
        feed.send(encode({"type": "add", "rid": f"r{i}", "prompt_token_ids": [5 + i] * 24, "params": params}))
        time.sleep(spacing_s)
    deadline = time.monotonic() + 30
    while (engine.has_unfinished() or not sizes) and time.monotonic() < deadline:
        time.sleep(0.01)
    feed.send(encode({"type": "shutdown"}))
    loop.join(10)
    sender.close()
    for s in (inbox, feed, outbox, drain):
        s.close(linger=0)
    ctx.term()
    assert not loop.is_alive() and not engine.has_unfinished()
    return sizes


@pytest.mark.processes
def test_a_burst_reaching_an_idle_engine_is_prefilled_in_one_step(tiny_checkpoint):
    assert _first_step_sizes(tiny_checkpoint, engine_process.IDLE_GATHER_MS / 1e3, 0.001)[0] == BURST


@pytest.mark.processes
def test_without_the_window_the_first_request_of_a_burst_steps_alone(tiny_checkpoint):
    """What the test above catches: no window (OURO_IDLE_GATHER_MS=0) steps at the first request (20 ms
    apart here, so the next cannot be in the inbox when the loop looks)."""
    assert _first_step_sizes(tiny_checkpoint, 0.0, 0.02)[0] < BURST


@pytest.mark.processes
def test_a_lone_request_waits_no_longer_than_the_gap(tiny_checkpoint):
    sizes = _first_step_sizes(tiny_checkpoint, engine_process.IDLE_GATHER_MS / 1e3, 0.05)   # 50 ms apart
    assert sizes[0] == 1        # the window closed GATHER_GAP_MS after the first: no waiting for the next


@pytest.mark.parametrize("value", ["soon", "-3", "2.5"])
def test_a_bad_window_is_refused_naming_the_variable(value, monkeypatch):
    monkeypatch.setenv("OURO_IDLE_GATHER_MS", value)
    with pytest.raises(ValueError, match="OURO_IDLE_GATHER_MS"):
        engine_process.idle_gather_ms()
    monkeypatch.setenv("OURO_IDLE_GATHER_MS", "0")
    assert engine_process.idle_gather_ms() == 0
    monkeypatch.delenv("OURO_IDLE_GATHER_MS")
    assert engine_process.idle_gather_ms() == engine_process.IDLE_GATHER_MS
