"""Projections of one input merged into one product (`ouro.layers.merged`): the same outputs as the
projections run one by one, remade when a weight changes, and never merged where a hook watches."""

import pytest
import torch

from ouro.machine.model_forms import apply_to
from ouro.layers.linear import Linear
from ouro.layers.merged import merged_module, project, project_cat
from ouro.quant.w8a8 import W8A8Linear


def rel_rms(a, b):
    return float((a.double() - b.double()).square().mean().sqrt() / b.double().square().mean().sqrt())


def group(widths, d_in=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    mods = [Linear(d_in, w, bias=False) for w in widths]
    for m in mods:
        m.weight.data = torch.randn(m.weight.shape, generator=g) / d_in ** 0.5
    return mods


@pytest.mark.parametrize("widths", [(16, 16, 16), (5, 33, 2), (64, 7)])
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("forms", [False, True])
def test_merged_linears_equal_the_separate_products(widths, rows, forms):
    mods = group(widths)
    if forms:
        apply_to(torch.nn.ModuleList(mods))
    x = torch.randn(rows, 48)
    with torch.no_grad():
        ref = [m(x) for m in mods]
        got = project(x, *mods)
        cat = project_cat(x, *mods)
    assert merged_module(mods) is not None
    for r, o in zip(ref, got):
        assert o.shape == r.shape and rel_rms(o, r) <= 1e-6
    assert rel_rms(cat, torch.cat(ref, -1)) <= 1e-6


def test_merged_w8a8_equals_the_separate_products():
    mods = [W8A8Linear.from_linear(m) for m in group((24, 8, 40))]
    x = torch.randn(5, 48)
    with torch.no_grad():
        ref = [m(x) for m in mods]
        got = project(x, *mods)
    assert merged_module(mods) is not None
    for r, o in zip(ref, got):
        assert torch.equal(o, r)       # per-token activation scales: the same for every part


def test_a_weight_changed_in_place_is_merged_again():
    mods = group((8, 8))
    x = torch.randn(2, 48)
    with torch.no_grad():
        project(x, *mods)
        mods[1].weight.mul_(-2.0)
        got = project(x, *mods)
        assert rel_rms(got[1], mods[1](x)) <= 1e-6


def test_a_watched_projection_runs_on_its_own_and_its_hook_sees_it():
    mods = group((8, 8, 8))
    seen = []
    h = mods[1].register_forward_hook(lambda m, a, out: seen.append(out))
    with torch.no_grad():
        got = project(torch.randn(2, 48), *mods)
    h.remove()
    assert len(seen) == 1 and torch.equal(seen[0], got[1])


def test_mixed_classes_and_autograd_run_one_by_one():
    a, b = group((8, 8))
    mixed = [a, W8A8Linear.from_linear(b)]
    assert merged_module(mixed) is None
    x = torch.randn(2, 48, requires_grad=True)
    out = project(x, a, b)            # autograd on: separate products, gradients flow to both
    sum(o.sum() for o in out).backward()
    assert a.weight.grad is not None and b.weight.grad is not None


def test_merged_under_inference_mode_with_packed_forms():
    """The engine runs under inference mode: the merged weight must still be a plain tensor (its
    packed copy keys on the version counter an inference tensor lacks)."""
    mods = group((16, 24))
    apply_to(torch.nn.ModuleList(mods))
    x = torch.randn(4, 48)
    with torch.inference_mode():
        got = project(x, *mods)
        again = project(x, *mods)
        ref = [m(x) for m in mods]
    for r, o, o2 in zip(ref, got, again):
        assert rel_rms(o, r) <= 1e-6 and torch.equal(o, o2)


def test_a_passive_hook_does_not_stop_the_merge():
    """The op recorder's and the breakdown's hooks observe without stopping a fused path."""
    from ouro.layers.watch import passive, watched
    mods = group((8, 8))
    calls = []
    h = mods[0].register_forward_pre_hook(passive(lambda m, a: calls.append(1)))
    assert not watched(*mods)
    h2 = mods[0].register_forward_hook(lambda m, a, o: None)
    assert watched(*mods)
    h.remove(), h2.remove()
