"""The routed experts' int8 form is picked apart from the projections', on a whole experts layer.

Where torch's `_int_mm` is about as fast as ouro's kernel on one product (a VNNI machine: an AMD EPYC
Zen 5 here), the shared pick handed the experts the per-expert path, 2-6x slower than the fused
call. Now the projections keep their pick and the experts take theirs, timed per expert shape."""

from __future__ import annotations

import pytest
import torch

from ouro import machine_cache
from ouro.models.loader import load_model
from ouro.models.resolve import resolve_model
from ouro.quant import int8_forms, int8_native, w8a8
from ouro.quant.int8_native import native
from ouro.quant.form_timers import balanced_routing, experts_kind
from ouro.quant.w8a8 import W8A8Experts, W8A8Linear, experts_timer, quantize_model


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OURO_CACHE", str(tmp_path))
    monkeypatch.setenv("OURO_BUSY_LIMIT", "1")          # timed beside other workers: kept all the same
    monkeypatch.delenv("OURO_INT8_FORM", raising=False)
    return tmp_path


def ranked(*order):
    """A timer under which the forms rank as `order` (first fastest); records what it was asked."""
    def timer(form, rows):
        timer.calls.append((form, rows))
        return 1.0 + (order.index(form) if form in order else len(order))
    timer.calls = []
    return timer


def test_the_experts_take_their_own_pick_and_the_projections_theirs(own_cache, monkeypatch):
    if native() is None or int8_forms.form_runs("int_mm") is not None:
        pytest.skip("needs ouro's int8 kernel and torch's _int_mm")
    products, experts = ranked("int_mm", "native", "chunked"), ranked("native", "int_mm", "chunked")
    shapes = []
    monkeypatch.setattr(w8a8, "_time_product", products)
    monkeypatch.setattr(w8a8, "experts_timer", lambda shape, k: shapes.append((tuple(shape), k)) or experts)
    model = load_model(resolve_model("tiny"))
    quantize_model(model)
    linears = [m for m in model.modules() if isinstance(m, W8A8Linear)]
    routed = [m for m in model.modules() if isinstance(m, W8A8Experts)]
    assert linears and routed
    assert all(m.int8_forms == ["int_mm"] * len(int8_forms.ROWS) for m in linears)
    assert all(m.int8_forms == ["native"] * len(int8_forms.ROWS) for m in routed)
    # the experts' timer was made for the model's own expert shape and top-k, once
    gate_up = routed[0].gate_up_proj_q.shape
    assert shapes == [(tuple(gate_up), model.config.num_experts_per_tok)]
    # at decode the routed experts then run as the one fused call, the projections as `_int_mm`
    x = torch.randn(2, model.config.hidden_size)
    ids = balanced_routing(1, gate_up[0], model.config.num_experts_per_tok)[:2]
    with torch.no_grad():
        assert routed[0].kernel_runs(x, ids)
    # both picks are cached apart: a second model times nothing
    cache = machine_cache.read(int8_forms.FILE)
    assert sorted(k.rsplit("|", 1)[-1] for k in cache) == sorted([f"kernel {int8_native.build_id()}", experts_kind(gate_up)])
    n_products, n_experts = len(products.calls), len(experts.calls)
    assert n_products and n_experts
    quantize_model(load_model(resolve_model("tiny")))
    assert (len(products.calls), len(experts.calls)) == (n_products, n_experts)


@pytest.mark.parametrize("rows,E,k", [(1, 8, 2), (16, 8, 2), (3, 5, 3), (128, 32, 4), (1, 4, 4)])
def test_balanced_routing_gives_every_expert_its_rows(rows, E, k):
    ids = balanced_routing(rows, E, k)
    assert ids.shape[1] == k
    counts = torch.bincount(ids.flatten(), minlength=E)
    assert counts.min() >= rows and counts.max() <= rows + 1
    assert all(len(set(row.tolist())) == k for row in ids)       # no expert twice in a token


def test_the_experts_timer_runs_each_form_on_a_layer_of_the_shape(monkeypatch):
    """It times the layer's forward (not one product), at the shape asked, in the form asked."""
    seen = []
    real = W8A8Experts.forward

    def forward(self, x, weights, experts):
        seen.append((tuple(self.gate_up_proj_q.shape), self.int8_forms[0], x.shape[0], experts.shape[1]))
        return real(self, x, weights, experts)
    monkeypatch.setattr(W8A8Experts, "forward", forward)
    timer = experts_timer((12, 24, 16), 3)
    for form in int8_forms.available_forms():
        t = timer(form, 4)
        assert 0 < t < 10
        shape, used, T, k = seen[-1]
        assert shape == (8, 24, 16) and used == form and k == 3 and T == balanced_routing(4, 8, 3).shape[0]
    timer("native", 1024)                # a prefill's rows an expert: fewer experts, ~2,048 tokens at most
    shape, _, T, k = seen[-1]
    assert shape == (3, 24, 16) and T == balanced_routing(1024, 3, 3).shape[0] <= 2048


def test_the_experts_kind_names_the_shape():
    assert experts_kind((32, 512, 512)) != experts_kind((32, 1024, 512)) != experts_kind((32, 512, 1024))


def test_another_build_of_the_kernel_is_timed_again(own_cache, monkeypatch):
    """A pick timed on one build of ouro's kernel is not kept for another (the VNNI path's offset
    change halved its products' time: a kept pick would have stayed with `_int_mm`)."""
    if native() is None:
        pytest.skip("needs ouro's int8 kernel")
    timer = ranked("native", "int_mm", "chunked")
    monkeypatch.setattr(int8_native, "build_id", lambda: "one")
    int8_forms.pick_forms("cpu", timer)
    n = len(timer.calls)
    int8_forms.pick_forms("cpu", timer)
    assert n and len(timer.calls) == n                       # the same build: cached
    monkeypatch.setattr(int8_native, "build_id", lambda: "two")
    int8_forms.pick_forms("cpu", timer)
    assert len(timer.calls) == 2 * n                         # another build: timed again
