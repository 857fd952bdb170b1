"""The compiled decode step by op group (`ouro.measure.op_breakdown`): each native op lands in its
group, each group's floor is its own work, and a real compiled step's groups are what its ops took."""

from __future__ import annotations

import pytest
import torch

from ouro.measure import op_breakdown
from ouro.measure.op_breakdown import (ELEMENTWISE, INDEXER, KDA, PRODUCTS, REST, ROUTED_ROW, ROWS, compiled_breakdown,
                                       format_compiled, group_of, op_floors)
from ouro.measure.roofline import Roofline
from ouro.measure.step_breakdown import MHC
from ouro.measure.step_cost import decode_cost


def test_each_op_lands_in_its_group():
    assert group_of("ouro_native::kda_decode") == KDA
    assert group_of("ouro_native::hc_post_pre") == group_of("ouro_native::hc_pre") == MHC
    assert group_of("ouro_int8::w8a8_experts") == ROUTED_ROW            # before the int8 products' prefix
    assert group_of("ouro_int8::w8a8_packed") == group_of("mkldnn::_linear_pointwise") == PRODUCTS
    assert group_of("ouro_native::pool_keys_write") == group_of("ouro_native::index_select_decode") == INDEXER
    assert group_of("aten::empty") is None and group_of("## Call CompiledFxGraph abc") is None


def test_the_floors_are_each_groups_own_work():
    from ouro.models.loader import load_model
    from ouro.models.resolve import resolve_model
    model = load_model(resolve_model("tiny"))
    memory = Roofline(flops_per_s=1e30, bytes_per_s=1e9)
    floors = op_floors(model, 40, 3, memory)
    cost = decode_cost(model, 40, 3)
    assert floors[KDA] == pytest.approx(cost.parts["cache_bytes"]["kda_state"] / 1e9)     # the state, not q/k/v's weights
    assert all(floors[g] > 0 for g in (KDA, MHC, "norms", PRODUCTS, ROUTED_ROW))
    # the products and the routed experts hold every weight once between them, with the small parts'
    weights = sum(w.numel() * w.element_size() for w in model.parameters() if w.dim() >= 2
                  and w is not model.embed_tokens.weight)
    assert floors[PRODUCTS] * 1e9 < weights


def test_a_compiled_step_by_op_group(monkeypatch):
    from ouro.config import EngineConfig
    from ouro.engine import decode_graph
    from ouro.engine.llm_engine import LLMEngine
    from ouro.engine.sampling import SamplingParams
    from ouro.models.loader import load_model
    from ouro.models.resolve import resolve_model
    monkeypatch.setattr(decode_graph, "BACKEND", "aot_eager")
    model = load_model(resolve_model("tiny"))
    engine = LLMEngine(model, None, EngineConfig(max_memory=16 << 20, compile=True, torch_compile_max_bs=2,
                                                 max_num_seqs=2, dtype="float32"), verbose=False)
    roof = Roofline(flops_per_s=1e11, bytes_per_s=1e10)
    prompts = [list(range(5, 25)), list(range(30, 47))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    b = compiled_breakdown(engine, prompts, 3, roof, params)
    rows = {r["part"]: r for r in b["rows"]}
    assert set(rows) == set(ROWS)
    assert rows[KDA]["ms"] > 0 and rows[MHC]["ms"] > 0 and rows["norms"]["ms"] > 0   # the fused ops were recorded
    # each step's groups add up to it (the rows are medians over steps, so their sum only near the median step)
    assert all(r["ms"] >= 0 for r in b["rows"])
    assert sum(r["ms"] for r in b["rows"]) == pytest.approx(b["profiled_step_ms"], rel=0.25)
    assert not engine.has_unfinished()
    text = format_compiled(b)
    assert all(g in text for g in ELEMENTWISE) and REST in text
    assert "floors at 100 GFLOP/s, 10.0 GB/s" in text         # the rates the floors came from


def test_an_engine_that_does_not_compile_is_refused():
    from ouro.config import EngineConfig
    from ouro.engine.llm_engine import LLMEngine
    from ouro.engine.sampling import SamplingParams
    from ouro.models.loader import load_model
    from ouro.models.resolve import resolve_model
    engine = LLMEngine(load_model(resolve_model("tiny")), None, EngineConfig(max_memory=16 << 20), verbose=False)
    with pytest.raises(ValueError, match="--compile"):
        compiled_breakdown(engine, [[1, 2, 3]], 2, Roofline(1e11, 1e10), SamplingParams(max_tokens=4))
    assert op_breakdown.ROWS[-1] == REST
