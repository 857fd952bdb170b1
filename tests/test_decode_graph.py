"""`--compile`: the decode step as one compiled graph at padded batch-size buckets.

The graph is traced with `fullgraph=True`, so a host sync or data-dependent Python in the decode
path fails the trace. It must give the eager path's logits and leave every real sequence's cache
(KDA states, latents, indexer keys and pooled keys) as the eager path leaves it, from a NaN-
poisoned cache, at batch sizes that need padding, with a fresh one-token sequence among them and
across indexer pool boundaries. The default run uses the `aot_eager` backend (the same capture and
functionalisation, no C++ build); the inductor build is the slow-marked test."""

import pytest
import torch

from ouro.engine import decode_graph
from ouro.engine.decode_graph import DecodeGraph, buckets, counting_backend as counting
from ouro.engine.simple_runner import SimpleRunner
from ouro.models.loader import load_model
from ouro.models.resolve import resolve_model

from numerics import rel_rms


def test_buckets():
    assert buckets(32) == [2, 4, 8, 16, 32]
    assert buckets(20) == [2, 4, 8, 16, 20]
    assert buckets(1) == [2] and buckets(2) == [2]


def cache_parts(cache, slots, pages):
    """Every cache tensor restricted to the given state slots and pages."""
    return {"conv": cache.conv[:, slots], "recurrent": cache.recurrent[:, slots],
            "latent": cache.latent[:, pages], "index_keys": cache.index_keys[:, pages],
            "index_gates": cache.index_gates[:, pages], "index_pooled": cache.index_pooled[:, pages]}


def graph_matches_eager(backend, scratch_slot_override=None):
    """Prefill 3 sequences on two identical poisoned caches, then decode on one eagerly and on the
    other through the graph: batches of 3, 1 and 4 rows (buckets 4, 2, 4), one row a fresh
    one-token prompt. Returns the worst logits error and whether the real caches agree."""
    torch.manual_seed(0)
    model = load_model(resolve_model("tiny"))
    n, max_len = 4, 48
    eager = SimpleRunner(model, n, max_len, poison=True)
    fast = SimpleRunner(model, n + 1, max_len, poison=True)    # the last slot and its pages: scratch
    scratch_slot = n if scratch_slot_override is None else scratch_slot_override
    back = counting(backend)
    graph = DecodeGraph(model, fast.cache, scratch_slot, int(fast.page_table[n, 0]), max_bs=4, backend=back)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, model.config.vocab_size, (L,), generator=g).tolist() for L in (21, 6, 30)]
    a = eager.step(prompts + [[]])
    b = fast.step(prompts + [[], []])
    assert torch.equal(a, b)
    last = [int(t) for t in a.argmax(-1)]
    worst = 0.0
    schedule = [[0, 1, 2]] * 3 + [[1]] + [[0, 1, 2, 3]] * 4     # row 3 joins as a fresh one-token prompt
    tokens = {0: last[0], 1: last[1], 2: last[2], 3: 11}
    ps = fast.page_size
    for rows in schedule:
        want = eager.step([[tokens[i]] if i in rows else [] for i in range(n)])
        pages = [fast.page_table[i, : fast.lengths[i] // ps + 1].tolist() for i in rows]
        with torch.inference_mode():
            got = graph.run([tokens[i] for i in rows], [fast.lengths[i] for i in rows], rows, pages)
        for i in rows:
            fast.lengths[i] += 1
        assert got.shape == want.shape and not torch.isnan(got).any()
        worst = max(worst, rel_rms(got, want))
        for j, i in enumerate(rows):
            tokens[i] = int(want[j].argmax())
    real_pages = fast.page_table[:n].flatten()
    same = all(torch.allclose(x.nan_to_num(7.0), y.nan_to_num(7.0), rtol=1e-4, atol=1e-5)
               for x, y in zip(cache_parts(eager.cache, list(range(n)), eager.page_table.flatten()).values(),
                               cache_parts(fast.cache, list(range(n)), real_pages).values()))
    return worst, same, graph, back.graphs


def test_graph_decode_equals_eager_and_leaves_the_same_cache():
    worst, same, graph, graphs = graph_matches_eager("aot_eager")
    assert worst < 1e-5, worst
    assert same, "the graph left a real sequence's cache different from the eager path"
    assert graph.runs == 8
    assert len(graphs) == 1, f"{len(graphs)} graphs traced: a batch size or table width was specialised"


@pytest.mark.slow
def test_padding_rows_writing_a_real_slot_is_caught():
    """The check above can fail: padding rows pointed at a real sequence's state slot corrupt it."""
    worst, same, _, _ = graph_matches_eager("aot_eager", scratch_slot_override=1)
    assert worst > 1e-3 or not same


@pytest.mark.slow
def test_graph_decode_equals_eager_inductor():
    worst, same, _, graphs = graph_matches_eager("inductor")
    assert worst < 1e-4 and same and len(graphs) == 1


@pytest.mark.slow
def test_engine_with_compile_generates_what_eager_does(monkeypatch):
    """LLM(compile=True) warms up every bucket, runs its decode steps through the graph (aot_eager
    here) and its greedy tokens are eager's; prefill steps stay eager."""
    from ouro.engine.llm import LLM
    from ouro.engine.sampling import SamplingParams
    back = counting("aot_eager")
    monkeypatch.setattr(decode_graph, "BACKEND", back)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 3]}, {"prompt_token_ids": [4] * 19}]
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    eager = [r.outputs[0].token_ids for r in LLM("tiny", max_memory=16 << 20).generate(prompts, params)]
    llm = LLM("tiny", max_memory=16 << 20, compile=True, max_num_seqs=4)
    fast = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
    assert fast == eager
    assert llm.engine.runner.graph.buckets == [2, 4]
    assert llm.engine.runner.graph.runs >= 6
    assert len(back.graphs) == 1


@pytest.mark.slow
def test_probe_reports_one_graph_and_names_a_planted_host_read(monkeypatch):
    """`ouro probe redundancy --graph`: clean, one graph (info); with a host read planted in the
    decode path, an error naming the planted line."""
    from ouro.layers.context import GraphContext
    from ouro.lab.graph_check import graph_finding
    model = load_model(resolve_model("tiny"))
    clean = graph_finding(model)
    assert clean.severity == "info" and clean.measured["graphs"] == 1, clean

    real = GraphContext.completed_pools

    def planted(self, kpool):
        if int(self.positions.max()) < 0:      # a host read: ends a fullgraph trace
            raise AssertionError
        return real(self, kpool)
    monkeypatch.setattr(GraphContext, "completed_pools", planted)
    broken = graph_finding(model)
    assert broken.severity == "error", broken
    assert broken.where["file"].endswith("test_decode_graph.py") and broken.where["function"] == "planted", broken.where
