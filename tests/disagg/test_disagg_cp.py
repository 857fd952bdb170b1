"""A prefill worker with `--cp 2` (a real helper process, gloo) and `--cp-layer-split`: a long
prompt prefilled across the ranks in several CP forwards reaches the decode worker complete (the
engine rank keeps every layer and sends each CP forward's rows), and the decode worker's greedy
tokens equal one engine's; a short prompt beside it takes the usual path. Every page comes back."""

import time

import pytest
import torch

from ouro.config import EngineConfig
from ouro.disagg.decode_engine import DecodeEngine
from ouro.disagg.prefill_engine import PrefillEngine
from ouro.engine.llm_engine import LLMEngine
from ouro.engine.sampling import SamplingParams
from ouro.models.loader import load_model

from ouro.lab.reference.checkpoint import make_hf_checkpoint

KW = dict(max_memory=48 << 20, page_size=16, dtype="float32", max_num_batched_tokens=64)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
LENGTHS = (100, 20)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("disagg_cp")
    make_hf_checkpoint("shared", d)          # 4 DSA layers: each CP rank owns 2
    return d


def prompts():
    g = torch.Generator().manual_seed(9)
    return [torch.randint(1, 300, (n,), generator=g).tolist() for n in LENGTHS]


def run(engine_out, p, d):
    t = time.monotonic()
    while (p.has_work() or d.has_work()) and time.monotonic() - t < 120:
        p.step()
        for o in d.step():
            engine_out.setdefault(o.request_id, []).extend(o.new_token_ids)
        time.sleep(0.001)
    return engine_out


@pytest.mark.processes
@pytest.mark.parametrize("split", [pytest.param(False, marks=pytest.mark.slow), True])    # LayerSplit's worker is CP's plus its split
def test_a_cp_prefill_worker_feeds_its_decode_worker(ckpt, split):
    one = LLMEngine(load_model(ckpt), None, EngineConfig(**KW), verbose=False)
    for i, ids in enumerate(prompts()):
        one.add_request({"prompt_token_ids": ids}, GREEDY, f"r{i}")
    want = {}
    while one.has_unfinished():
        for o in one.step():
            want.setdefault(o.request_id, []).extend(o.new_token_ids)
    cp = EngineConfig(**KW, context_parallel_size=2, cp_threshold=48, cp_chunk_size=32, cp_layer_split=split)
    p = PrefillEngine(LLMEngine(load_model(ckpt), None, cp, verbose=False, model_dir=str(ckpt)))
    d = DecodeEngine(LLMEngine(load_model(ckpt), None, EngineConfig(**KW), verbose=False))
    try:
        for i, ids in enumerate(prompts()):
            p.add(f"r{i}", ids, GREEDY, d.reserve(f"r{i}", ids, GREEDY))
        got = run({}, p, d)
        assert got == want and not d.failures
        assert p.engine.cp.num_prefills == 1                      # the long prompt went across the ranks
        if split:
            assert p.engine.cp.split_stats["broadcasts"] > 0      # later CP forwards took their layers' rows by broadcast
        for e in (p.engine, d.engine):
            assert e.pages.num_free == e.pages.num_total and e.slots.num_free == e.slots.num_total
    finally:
        p.close()
        d.close()
        p.engine.close()


def test_disagg_passes_cp_to_the_prefill_workers_only():
    from ouro.cli import build_parser
    from ouro.disagg.command import run_role, worker_argv
    args = build_parser().parse_args(["serve", "--model", "tiny", "--disagg", "1P1D", "--cp", "2", "--cp-threshold", "64",
                                      "--cp-chunk-size", "32", "--enable-cp-cache-layer-split"])
    pre, dec = worker_argv(args, "prefill", 30000), worker_argv(args, "decode", 30002)
    back = build_parser().parse_args(pre[3:])
    assert (back.cp, back.cp_threshold, back.cp_chunk_size, back.cp_layer_split) == (2, 64, 32, True)
    assert "--cp" not in dec
    with pytest.raises(ValueError, match="only a prefill worker"):
        run_role(build_parser().parse_args(["serve", "--role", "decode", "--model", "tiny", "--cp", "2"]))
