"""`--compile`: the decode step as a compiled graph at padded batch-size buckets (batch 1 its own graph).

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
from ouro.native import kernels
from ouro.models.loader import load_model
from ouro.models.resolve import resolve_model

from tests.helpers.numerics import rel_rms


def test_buckets():
    assert buckets(32) == [1, 2, 4, 8, 16, 32]
    assert buckets(20) == [1, 2, 4, 8, 16, 20]
    assert buckets(1) == [1] and buckets(2) == [1, 2]


def cache_parts(cache, slots, pages):
    """Every cache tensor restricted to the given state slots and pages."""
    return {"conv": cache.conv[:, slots], "recurrent": cache.recurrent[:, slots],
            "latent": cache.latent[:, pages], "index_keys": cache.index_keys[:, pages],
            "index_gates": cache.index_gates[:, pages], "index_pooled": cache.index_pooled[:, pages]}


def graph_matches_eager(backend, scratch_slot_override=None, model=None):
    """Prefill 3 sequences on two identical poisoned caches, then decode on one eagerly and on the
    other through the graph: batches of 3, 1 and 4 rows (buckets 4, 1, 4), one row a fresh
    one-token prompt. Returns the worst logits error and whether the real caches agree."""
    torch.manual_seed(0)
    model = model if model is not None else load_model(resolve_model("tiny"))
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
    # every step after a (bucket, width)'s first called the graph without dynamo's frame
    assert sum(d.calls for d in graph._direct.values() if d is not None) == graph.runs - len(graph._direct)
    # batch 1 is a graph of its own (torch specialises size 1); every other batch and width shares one
    assert len(graphs) == 2, f"{len(graphs)} graphs traced: a batch size or table width was specialised"


def test_the_graph_guards_nothing_on_the_model_and_a_hook_added_later_sends_steps_eager():
    """Dynamo's thousands of guards on the model (module attributes, hooks, parameters) were most of
    a batch-1 step's host time: the graph keeps none (`_sealed_guards`), so a changed module
    attribute does not trace again, and `accepts` sends a step eagerly while the model has a forward
    hook it did not have at the first trace (the lab's timers), and back once it is gone."""
    torch.manual_seed(0)
    model = load_model(resolve_model("tiny"))
    runner = SimpleRunner(model, 1, 32)         # its one slot and its pages: the graph's scratch
    back = counting("aot_eager")
    graph = DecodeGraph(model, runner.cache, 0, int(runner.page_table[0, 0]), max_bs=2, backend=back)
    graphs = back.graphs

    def one_step():       # a fresh one-token sequence in the scratch slot: the same logits each time
        with torch.inference_mode():
            return graph.run([3], [0], [graph.scratch_slot], [[graph.scratch_page]])

    before = one_step()
    n = len(graphs)
    assert not before.isnan().any() and n == 1 and graph.accepts([1, 1], False)
    eps = model.norm.eps
    model.norm.eps = eps * 2           # guarded by default: a new trace
    try:
        one_step()
        assert len(graphs) == n, "the graph traced again for a module attribute: it guards the model"
    finally:
        model.norm.eps = eps
    calls = []
    handle = model.layers[1].register_forward_hook(lambda *a: calls.append(1))
    assert not graph.accepts([1], False), "a hook added after the first trace would not run in the graph"
    other = torch.nn.Linear(2, 2).register_forward_hook(lambda *a: None)    # not the model's: no effect
    handle.remove()
    assert graph.accepts([1], False)
    other.remove()
    assert graph.accepts([1], False)
    handle = model.register_forward_pre_hook(lambda *a: None)
    assert not graph.accepts([1], False)
    handle.remove()
    assert graph.accepts([1], False) and torch.equal(before, one_step())


def test_the_graph_called_without_dynamos_frame_matches_dynamos_call_bit_for_bit():
    """`graph_direct.DirectCall`: after a (bucket, width)'s first step through dynamo, its graph is
    called with the step's inputs put into a prepared argument list. The same step (fresh one-token
    sequences in the scratch slot: a fresh row starts from a zero state, so the step repeats exactly)
    through dynamo and then directly, at batches 1 and 2 and table widths 2 and 4: logits bit for bit;
    the second call of each key went direct; a direct call fed the wrong input gives other logits.
    (The test against eager above runs the direct path over real contexts.)"""
    torch.manual_seed(0)
    model = load_model(resolve_model("tiny"))
    runner = SimpleRunner(model, 1, 96)         # its one slot and its pages: the graph's scratch
    graph = DecodeGraph(model, runner.cache, 0, int(runner.page_table[0, 0]), max_bs=2, backend="aot_eager")
    pages = runner.page_table[0].tolist()

    def step(B, width, direct):
        graph.direct = direct
        with torch.inference_mode():
            return graph.run([3 + b for b in range(B)], [0] * B, [0] * B, [pages[:width]] * B)

    assert graph.min_width <= 2
    for B in (1, 2):
        for width in (2, 4):
            through_dynamo = step(B, width, False)
            direct = step(B, width, True)          # the key's first call with direct on makes its DirectCall
            again = step(B, width, True)
            assert not through_dynamo.isnan().any()
            assert torch.equal(through_dynamo, direct) and torch.equal(direct, again), (B, width)
    calls = {k[:2]: d.calls for k, d in graph._direct.items() if d is not None}
    assert calls == {(1, 2): 1, (1, 4): 1, (2, 2): 1, (2, 4): 1}, calls

    with kernels.eager_only():      # a fused-path switch turned: dynamo traces again under a new key
        eager = step(1, 2, True)
        assert len(graph._direct) == 5 and torch.equal(eager, step(1, 2, True))
    assert rel_rms(eager, step(1, 2, False)) < 1e-5     # the fused graph's key again: to rounding

    call = next(d for k, d in graph._direct.items() if k[:2] == (1, 2) and not k[2][0])   # the mutation:
    assert sorted(k for _, k in call.inputs_at) == list(range(6))                          # the ids' slot
    call.inputs_at = [(i, 1 if k == 0 else k) for i, k in call.inputs_at]                  # fed positions
    assert not torch.equal(step(1, 2, True), step(1, 2, False))


def graph_targets(graphs) -> list[str]:
    return [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("quantization", [None, "w8a8"])
def test_graph_calls_the_native_products_directly(quantization, monkeypatch):
    """Inside the graph the routed experts, the oneDNN-packed float projections and (W8A8) every int8
    projection run as direct native ops on the packed copies the eager pass before the trace made,
    merged where eager merges them: no product goes back to Python through `ouro::opaque_call`. Same logits and caches as eager. The
    int8 form is pinned to ouro's kernel: where `_int_mm` is as fast (a VNNI machine), the pick
    between them flips from run to run."""
    monkeypatch.setenv("OURO_INT8_FORM", "native")
    from ouro.native import kernels
    from ouro.quant.int8_native import native
    from ouro.quant.w8a8 import quantize_model
    if not kernels.load("experts") or (quantization and native() is None):
        pytest.skip("the native kernels cannot be built here")
    torch.manual_seed(0)
    model = load_model(resolve_model("tiny"))
    if quantization:
        quantize_model(model, quantization)
    worst, same, graph, graphs = graph_matches_eager("aot_eager", model=model)
    assert worst < (1e-5 if quantization is None else 1e-4), worst
    assert same
    targets = graph_targets(graphs)
    from ouro.ops.opaque import _module
    opaque = {type(_module(n.args[1])).__name__ for gm in graphs for n in gm.graph.nodes
              if n.op == "call_function" and "opaque_call" in str(n.target)}
    # the tests pin float32 projections to the oneDNN-packed form (conftest): the graph calls that product
    # as `ouro_native.packed_linear` where the op is built, as an opaque op otherwise
    if kernels.load("onednn"):
        assert not opaque, opaque
        assert any("ouro_native.packed_linear" in t for t in targets)
    else:
        assert opaque <= {"Linear"}, opaque
    # the new cache rows are stored in place (an index_put on a cache layer became a copy of the layer)
    assert any("ouro_native.write_rows" in t for t in targets)
    if quantization:
        assert any("ouro_int8.w8a8_packed" in t for t in targets) and any("ouro_int8.w8a8_experts" in t for t in targets)
        # merged: fewer int8 products than int8 projections in the model
        products = sum("w8a8_packed" in t for t in graph_targets(graphs[:1]))
        layers = sum(type(m).__name__ == "W8A8Linear" for m in model.modules())
        assert 0 < products < layers, (products, layers)
    else:
        assert any("ouro_native.moe_experts" in t for t in targets)


def test_graph_calls_the_panels_product_directly(monkeypatch):
    """Where the measured float32 form is `panels` (a decode step's rows on column panels), the graph
    calls `ouro_native.panel_linear` on the plain weights, the op keeping the packed copies: same
    logits and caches as eager, no product through Python."""
    from ouro.native import kernels
    from ouro.ops.opaque import _module
    if not (kernels.load("panels") and kernels.load("experts")):
        pytest.skip("the native kernels cannot be built here")
    monkeypatch.setenv("OURO_GEMM_PICK", "panels")
    torch.manual_seed(0)
    model = load_model(resolve_model("tiny"))
    worst, same, _, graphs = graph_matches_eager("aot_eager", model=model)
    assert worst < 1e-5, worst
    assert same
    targets = graph_targets(graphs)
    assert any("ouro_native.panel_linear" in t for t in targets)
    assert not any("packed_linear" in t or "mkldnn" in t for t in targets)
    assert not any(n.op == "call_function" and "opaque_call" in str(n.target) and type(_module(n.args[1])).__name__ == "Linear"
                   for gm in graphs for n in gm.graph.nodes)


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_int8_projections_in_torchs_int_mm_form_are_traced_not_opaque(monkeypatch, backend):
    """Where the measured int8 form is torch's `_int_mm` (a Xeon with AMX picks it from 16 rows), a
    graph traces the rows' quantisation, `_int_mm` and the scales as they are: no W8A8 projection
    re-enters Python through `ouro::opaque_call` (~250 us a call there). Same logits and caches."""
    from ouro.ops.opaque import _module
    from ouro.quant import int8_forms
    from ouro.quant.int8_forms import form_runs
    from ouro.quant.w8a8 import quantize_model
    if form_runs("int_mm") is not None:
        pytest.skip(f"torch._int_mm does not run here: {form_runs('int_mm')}")
    monkeypatch.setenv("OURO_INT8_FORM", "int_mm")
    torch.manual_seed(0)
    model = load_model(resolve_model("tiny"))
    quantize_model(model, "w8a8")
    assert all(m.int8_forms == ["int_mm"] * len(int8_forms.ROWS) for m in model.modules() if type(m).__name__ == "W8A8Linear")
    worst, same, _, graphs = graph_matches_eager(backend, model=model)
    assert worst < 1e-5, worst
    assert same
    opaque = {type(_module(n.args[1])).__name__ for gm in graphs for n in gm.graph.nodes
              if n.op == "call_function" and "opaque_call" in str(n.target)}
    assert "W8A8Linear" not in opaque, opaque
    assert any("_int_mm" in t for t in graph_targets(graphs))


@pytest.mark.slow
def test_padding_rows_writing_a_real_slot_is_caught():
    """The check above can fail: padding rows pointed at a real sequence's state slot corrupt it."""
    worst, same, _, _ = graph_matches_eager("aot_eager", scratch_slot_override=1)
    assert worst > 1e-3 or not same


@pytest.mark.slow
def test_graph_decode_equals_eager_inductor():
    worst, same, _, graphs = graph_matches_eager("inductor")
    assert worst < 1e-4 and same and len(graphs) == 2


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
    assert llm.engine.runner.graph.buckets == [1, 2, 4]
    assert llm.engine.runner.graph.runs >= 6
    # batch 1 is its own graph; the engine's measured product forms (gemm_pick) may change with the
    # row count, and a graph runs the form measured for its rows: at most one graph per bucket, none
    # for a page-table width
    assert 2 <= len(back.graphs) <= 3


@pytest.mark.slow
def test_probe_reports_one_graph_and_names_a_planted_host_read(monkeypatch):
    """`ouro probe redundancy --graph`: clean, one graph (info); with a host read planted in the
    decode path, an error naming the planted line."""
    from ouro.layers.context import GraphContext
    from ouro.lab.redundancy.graph_check import graph_finding
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


@pytest.mark.slow
def test_a_second_engine_compiled_in_the_same_process_generates_what_eager_does(monkeypatch):
    """Dynamo keys what it learns about sizes by the function's file, line and name: each graph's
    `_forward` has a name of its own, else a W8A8 engine compiled by inductor after another compiled
    engine in the same process generated wrong tokens."""
    from ouro.engine.llm import LLM
    from ouro.engine.sampling import SamplingParams
    monkeypatch.setattr(decode_graph, "BACKEND", "aot_eager")
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9, 10, 11, 12]}]
    LLM("tiny-py", max_memory=128 << 20, page_size=16, compile=True, max_num_seqs=8).generate(prompts, greedy)
    monkeypatch.setattr(decode_graph, "BACKEND", "inductor")
    want = [r.outputs[0].token_ids for r in LLM("tiny", max_memory=16 << 20, quantization="w8a8").generate(prompts, greedy)]
    llm = LLM("tiny", max_memory=16 << 20, quantization="w8a8", compile=True, torch_compile_max_bs=4, max_num_seqs=4)
    assert [r.outputs[0].token_ids for r in llm.generate(prompts, greedy)] == want


def test_a_bfloat16_graph_holds_the_fused_ops_and_matches_eager():
    """A bfloat16 model's decode graph runs the fused families that take bfloat16 (their fakes give
    the eager dtypes: a wrong one breaks the trace) and gives the eager bfloat16 step's logits."""
    from ouro.native import kernels
    if not kernels.load("experts"):
        pytest.skip("the native kernels cannot be built here")
    torch.manual_seed(0)
    model = load_model(resolve_model("tiny"), dtype=torch.bfloat16)
    worst, same, graph, graphs = graph_matches_eager("aot_eager", model=model)
    assert worst < 1e-6, worst        # the same ops on the same bfloat16 values (0.0 here)
    assert same
    targets = graph_targets(graphs)
    for op in ("moe_experts", "hc_post_pre", "kda_decode", "route", "rms_norm", "sparse_mla_decode", "index_select_decode"):
        assert any(f"ouro_native.{op}" in t for t in targets), op
