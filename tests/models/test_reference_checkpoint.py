"""The reference checkpoints themselves: no constant tensor is left for an implementation to
ignore, and transformers' indexer follows the one tie rule ouro uses (earlier pool wins)."""

import pytest
import torch
from torch import nn

from ouro.lab.reference import tie_rule as hf_tie_rule
from ouro.lab.reference.random_init import constant_tensors, randomize_constants


@pytest.mark.parametrize("shape", ["tiny", "shared"])
def test_no_tensor_of_the_reference_is_constant(hf_pair, shape):
    _, hf, model = hf_pair(shape)
    assert constant_tensors(hf) == []  # as loaded back from disk
    same = [n for n, t in model.state_dict().items() if t.numel() > 1 and bool((t == t.flatten()[0]).all())]
    assert same == []


def test_a_constant_tensor_without_a_rule_is_caught():
    m = nn.Module()
    m.model = nn.Module()
    m.model.language_model = nn.Module()
    m.model.language_model.surprise_scale = nn.Parameter(torch.ones(3))
    with pytest.raises(AssertionError, match="surprise_scale"):
        randomize_constants(m)


def first_pools(p, topk, kpool):
    """What a constant score selects under the earlier-pool rule: the first pools, and the tail."""
    complete = (p + 1) // kpool * kpool
    return set(range(min(topk, complete))) | set(range(complete, p + 1))


def test_transformers_indexer_breaks_ties_towards_earlier_pools(hf_pair):
    _, hf, model = hf_pair("tiny")
    c = model.config
    assert hf_tie_rule.installed()
    layer = next(i for i, t in enumerate(c.layer_types) if t == "indexed_attention")
    indexer = hf.model.language_model.layers[layer].self_attn.indexer
    g = torch.Generator().manual_seed(0)
    x, q_resid = torch.randn(1, 300, c.hidden_size, generator=g), torch.randn(1, 300, c.q_lora_rank, generator=g)
    args = dict(hidden_states=x, q_resid=q_resid, attention_mask=torch.ones(1, 300, dtype=torch.bool), cache=None)
    saved = indexer.wq_b.weight.detach().clone()
    try:
        with torch.no_grad():
            indexer.wq_b.weight.zero_()  # every pool scores exactly 0
            sel = indexer(**args)[0]
            unwrapped = type(indexer).forward._ouro_original(indexer, **args)[0]
    finally:
        with torch.no_grad():
            indexer.wq_b.weight.copy_(saved)
    picked = lambda s, p: set(s[p][s[p] >= 0].tolist())
    assert all(picked(sel, p) == first_pools(p, c.index_topk, c.index_kpool) for p in range(300))
    # without the rule torch's topk picks among the tied pools in its own order: the rule matters
    assert any(picked(unwrapped, p) != first_pools(p, c.index_topk, c.index_kpool) for p in range(300))


def test_stable_topk_breaks_ties_by_index():
    x = torch.tensor([[0.0, 3.0, 0.0, 0.0, 3.0, 0.0, -1.0]])
    v, i = hf_tie_rule.stable_topk(x, 4)
    assert i.tolist() == [[1, 4, 0, 2]] and v.tolist() == [[3.0, 3.0, 0.0, 0.0]]


def test_rule_is_active_only_inside_the_indexer(hf_pair, monkeypatch):
    """One stable top-k per indexer call; the MoE router's top-k calls stay torch's own."""
    _, hf, model = hf_pair("shared")
    calls = []
    original = hf_tie_rule.stable_topk
    monkeypatch.setattr(hf_tie_rule, "stable_topk", lambda *a, **k: calls.append(1) or original(*a, **k))
    with torch.no_grad():
        hf(torch.arange(40).view(1, -1))
    assert len(calls) == len(model.config.indexer_layers)
