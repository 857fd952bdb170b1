"""Mutation matrix: the comparison against transformers must notice every part of the model.

Each case breaks ouro on purpose (a weight ignored, a head order swapped, a state not carried, a
loop off by one) in a copy of the loaded model, and the same comparison the model tests use
(300-token prefill logits, then greedy decode steps with transformers' cache; rel RMS <= 1e-4 and
equal tokens) must fail. The un-mutated control must pass."""

import copy
import re

import pytest
import torch

import ouro.layers.dsa as dsa_layer
import ouro.layers.kda as kda_layer
from ouro.lab.reference.compare import TOL, compare, reference_run
from ouro.native.kernels import eager_only

PROMPT, DECODE = 300, 6


@pytest.fixture(scope="module")
def tiny(hf_pair):
    _, hf, model = hf_pair("tiny")
    ids = torch.randint(0, model.config.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(11))
    return model, reference_run(hf, ids, DECODE)


def params(model, pattern):
    found = [t for n, t in list(model.named_parameters()) + list(model.named_buffers()) if re.search(pattern, n)]
    assert found, f"no tensor matches {pattern!r}"
    return found


def reset(pattern, value):
    """ouro ignores a weight: it acts as if the tensor held transformers' constant init."""
    def apply(model, mp):
        for t in params(model, pattern):
            t.data.fill_(value)
    return apply


def edit(pattern, fn):
    def apply(model, mp):
        for t in params(model, pattern):
            t.data.copy_(fn(t.data))
    return apply


def hook_output(select, fn):
    """Replace the output of the sub-modules `select(model)` by fn(output)."""
    def apply(model, mp):
        for m in select(model):
            m.register_forward_hook(lambda mod, args, out: fn(out))
    return apply


def hook_input(select, fn):
    def apply(model, mp):
        for m in select(model):
            m.register_forward_pre_hook(lambda mod, args: (fn(args[0]),))
    return apply


def indexers(model):
    return [l.self_attn.indexer for l in model.layers if not l.is_kda and l.self_attn.indexer is not None]


def swap_heads(n_heads):
    def fn(x):  # [T, H * d]: swap heads 0 and 1
        y = x.view(x.shape[0], n_heads, -1).clone()
        y[:, [0, 1]] = y[:, [1, 0]]
        return y.view_as(x)
    return fn


def drop_tail(model, mp):
    original = dsa_layer.index_select

    def without_tail(q, w, pooled, positions, select_k, kpool, *rest):
        sel = original(q, w, pooled, positions, select_k, kpool, *rest)
        first_tail = torch.div(positions + 1, kpool, rounding_mode="floor") * kpool
        return sel.masked_fill(sel >= first_tail[:, None], -1)
    mp.setattr(dsa_layer, "index_select", without_tail)


def sinkhorn_iters(delta):
    def apply(model, mp):
        for l in model.layers:
            l.attn_hc.iters += delta
            l.ffn_hc.iters += delta
    return apply


def conv_state_dropped_in_decode(model, mp):
    original = kda_layer.causal_conv1d

    def conv(x, weight, state, lengths):
        return original(x, weight, torch.zeros_like(state) if x.shape[-1] == 1 else state, lengths)
    mp.setattr(kda_layer, "causal_conv1d", conv)


def recurrent_state_dropped_in_decode(model, mp):
    original = kda_layer.kda_recurrent_step

    def step(q, k, v, g, beta, state):
        state.zero_()
        return original(q, k, v, g, beta, state)
    mp.setattr(kda_layer, "kda_recurrent_step", step)


H, HK = 2, 2  # tiny: attention heads, KDA heads
MUTATIONS = {
    "indexer query = mean over tokens": hook_output(lambda m: [i.wq_b for i in indexers(m)],
                                                    lambda o: o.mean(0, keepdim=True).expand_as(o)),
    "indexer query from previous token": hook_output(lambda m: [i.wq_b for i in indexers(m)],
                                                     lambda o: torch.cat([o[:1], o[:-1]])),
    "indexer heads swapped": hook_output(lambda m: [i.weights_proj for i in indexers(m)], lambda o: o.flip(-1)),
    "compress ape ignored": reset(r"index_kpool_compress_ape$", 0.0),
    "compress gate ignored": reset(r"index_kpool_compress_gate$", 0.0),
    "input_layernorm weight ignored": reset(r"input_layernorm\.weight$", 1.0),
    "post_attention_layernorm weight ignored": reset(r"post_attention_layernorm\.weight$", 1.0),
    "final norm weight ignored": reset(r"^norm\.weight$", 1.0),
    "q_a_layernorm weight ignored": reset(r"q_a_layernorm\.weight$", 1.0),
    "kv_a_layernorm weight ignored": reset(r"kv_a_layernorm\.weight$", 1.0),
    "indexer k_norm weight ignored": reset(r"k_norm\.weight$", 1.0),
    "indexer k_norm bias ignored": reset(r"k_norm\.bias$", 0.0),
    "KDA gated o_norm weight ignored": reset(r"o_norm\.weight$", 1.0),
    "A_log ignored": reset(r"A_log$", 0.0),
    "hc scale ignored": reset(r"hc\.scale$", 1.0),
    "hc base ignored": reset(r"hc\.base$", 0.0),
    "router correction bias ignored": reset(r"e_score_correction_bias$", 0.0),
    "attention heads swapped": hook_input(lambda m: [l.self_attn.o_proj for l in m.layers if not l.is_kda],
                                          swap_heads(H)),
    "KDA heads swapped": hook_input(lambda m: [l.self_attn.o_proj for l in m.layers if l.is_kda], swap_heads(HK)),
    "tail pool dropped": drop_tail,
    "Sinkhorn one iteration more": sinkhorn_iters(+1),
    "Sinkhorn one iteration fewer": sinkhorn_iters(-1),
    "conv kernel taps reversed": edit(r"[qkv]_conv1d\.weight$", lambda w: w.flip(-1)),
    "conv window not carried into decode": conv_state_dropped_in_decode,
    "recurrent state not carried into decode": recurrent_state_dropped_in_decode,
}
DECODE_ONLY = {"conv window not carried into decode", "recurrent state not carried into decode"}
# mutations of an eager function that a fused native op replaces on this CPU (the op has its own tests)
EAGER_FUNCTIONS = DECODE_ONLY | {"tail pool dropped"}


def test_control_passes(tiny):
    model, ref = tiny
    result = compare(model, ref)
    assert result.passes(), str(result)


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_mutation_is_caught(tiny, name, monkeypatch):
    model, ref = tiny
    assert model.config.num_attention_heads == H and model.config.linear_num_heads == HK
    mutant = copy.deepcopy(model)
    MUTATIONS[name](mutant, monkeypatch)
    # these break eager functions (the KDA step's, the indexer's selection): the fused ops have their own tests
    with eager_only(name in EAGER_FUNCTIONS):
        result = compare(mutant, ref)
    assert not result.passes(), f"{name!r} not caught: {result}"
    if name in DECODE_ONLY:  # only the decode steps can see these
        assert result.prefill <= TOL and (result.decode > TOL or not result.tokens_match), str(result)
