import math

import pytest
import torch

from ouro.engine.sampling import SampleOutput, Sampler, SamplingParams, greedy_picks, make_generator, sample_reference


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.1), "min_p"),
    (dict(max_tokens=-1), "max_tokens"),   # 0: prefill only (a prompt scored)
    (dict(n=0), "n"),
    (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=21), "logprobs"),
    (dict(stop=""), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(seed=1.5), "seed"),
])
def test_params_validation(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} must"):
        SamplingParams(**kwargs)
    p = SamplingParams()
    for k, v in kwargs.items():
        setattr(p, k, v)
    with pytest.raises(ValueError, match=f"^{field} must"):
        p.validate()


def test_params_defaults_and_stop_list():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (1, 1.0, 1.0, 0, 0.0, 16)
    assert p.seed is None and p.logprobs is None and p.skip_special_tokens and not p.ignore_eos
    assert p.stop_list == []
    assert SamplingParams(stop="END").stop_list == ["END"]
    assert SamplingParams(stop=["a", "bc"]).stop_list == ["a", "bc"]
    SamplingParams(top_k=-1, top_p=1.0, min_p=1.0, logprobs=20, temperature=0.0)  # edges are valid


def _gens(seeds):
    return [make_generator(s, 0) for s in seeds]


def test_make_generator_seed_and_fallback():
    a, b = make_generator(7, 100), make_generator(7, 200)
    assert torch.equal(torch.rand(8, generator=a), torch.rand(8, generator=b))
    c, d = make_generator(None, 100), make_generator(None, 101)
    assert not torch.equal(torch.rand(8, generator=c), torch.rand(8, generator=d))
    assert torch.equal(torch.rand(8, generator=make_generator(None, 100)),
                       torch.rand(8, generator=make_generator(100, 0)))


def test_greedy_is_argmax_with_low_id_ties():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    logits[2, 7] = logits[2, 30] = logits[2].max() + 1.0  # tie between ids 7 and 30
    out = Sampler().sample(logits, [SamplingParams(temperature=0.0)] * 6, [None] * 6)
    assert isinstance(out, SampleOutput)
    expected = logits.argmax(dim=-1).tolist()
    assert out.token_ids == expected and out.token_ids[2] == 7


def test_greedy_picks_equal_argmax_over_a_vocabulary_with_ties_and_nan():
    # greedy_picks is max(dim).indices (faster than argmax on a CPU): the same first maximum across a
    # vector kernel's lanes and blocks, and the first NaN, as argmax
    torch.manual_seed(0)
    logits = torch.randn(5, 32000)
    logits[0, 31999] = logits[0, 17] = logits[0, 20000] = 50.0       # ties far apart: the lowest id
    logits[1, 100:] = logits[1].max() + 1.0                           # a long run of equal maxima
    logits[2, 9000] = logits[2, 4] = float("nan")                     # the first NaN, as argmax
    logits[3, 31999] = 60.0                                           # the last column
    assert torch.equal(greedy_picks(logits), logits.argmax(dim=-1))
    assert greedy_picks(logits).tolist()[:4] == [17, 100, 4, 31999]
    out = Sampler().sample(logits, [SamplingParams(temperature=0.0)] * 5, [None] * 5)
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_seeded_draws_independent_of_batch():
    torch.manual_seed(1)
    vocab, steps = 64, 6
    target = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, seed=123)
    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.3, top_p=0.5),
              SamplingParams(top_k=3), SamplingParams(temperature=0.7, min_p=0.3)]
    logits = [torch.randn(5, vocab) * 3 for _ in range(steps)]
    sampler = Sampler()
    alone_gen = _gens([123])
    alone = [sampler.sample(l[2:3], [target], alone_gen).token_ids[0] for l in logits]
    # Same target row in the middle of a batch with different neighbours and seeds.
    batch_gens = _gens([5, 6, 123, 7, 8])
    params = others[:2] + [target] + others[2:]
    batched = [sampler.sample(l, params, batch_gens).token_ids[2] for l in logits]
    assert alone == batched
    assert len(set(alone)) > 1  # really sampled, not a degenerate constant


def test_top_k_one_and_tiny_top_p_are_greedy():
    torch.manual_seed(2)
    logits = torch.randn(8, 100) * 2
    argmax = logits.argmax(dim=-1).tolist()
    sampler = Sampler()
    for params in (SamplingParams(top_k=1, temperature=1.5), SamplingParams(top_p=1e-6, temperature=2.0)):
        for seed in range(5):
            out = sampler.sample(logits, [params] * 8, _gens(range(seed, seed + 8)))
            assert out.token_ids == argmax


@pytest.mark.parametrize("params", [
    SamplingParams(min_p=0.1),
    SamplingParams(min_p=0.05, temperature=0.7),
    SamplingParams(top_k=10, top_p=0.8, min_p=0.02, temperature=1.3),
    SamplingParams(top_p=0.6),
    SamplingParams(top_k=5),
    SamplingParams(temperature=0.0),
])
def test_keep_mask_matches_reference(params):
    torch.manual_seed(3)
    logits = torch.randn(12, 80) * 2
    mask = Sampler().keep_mask(logits, [params] * 12)
    for r in range(12):
        _, ref = sample_reference(logits[r], params, make_generator(0, 0))
        assert torch.equal(mask[r], ref), f"row {r}"
    kept = mask.sum(dim=-1)
    assert (kept >= 1).all()
    if params.min_p > 0 or params.top_p < 1 or params.top_k > 0:
        assert (kept < 80).any()  # the filter actually removed something


def test_sampled_tokens_stay_inside_mask():
    torch.manual_seed(4)
    logits = torch.randn(4, 40) * 3
    params = [SamplingParams(top_k=4), SamplingParams(top_p=0.5), SamplingParams(min_p=0.2), SamplingParams()]
    sampler = Sampler()
    mask = sampler.keep_mask(logits, params)
    gens = _gens([1, 2, 3, 4])
    for _ in range(50):
        out = sampler.sample(logits, params, gens)
        assert all(mask[r, t] for r, t in enumerate(out.token_ids))


def _empirical(logits_row, params, draws=4000, seed=0):
    gen = make_generator(seed, 0)
    out = Sampler().sample(logits_row.expand(draws, -1), [params] * draws, [gen] * draws)
    return torch.bincount(torch.tensor(out.token_ids), minlength=logits_row.numel()).float() / draws


def test_empirical_distribution_matches_softmax():
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.5])
    freq = _empirical(logits, SamplingParams(temperature=1.0))
    assert (freq - logits.softmax(-1)).abs().max() < 0.03
    # temperature 2 flattens, and top_k=2 renormalises over the two best tokens.
    freq = _empirical(logits, SamplingParams(temperature=2.0), seed=1)
    assert (freq - (logits / 2).softmax(-1)).abs().max() < 0.03
    freq = _empirical(logits, SamplingParams(top_k=2), seed=2)
    expected = torch.zeros(5)
    expected[[3, 0]] = logits[[3, 0]].softmax(-1)
    assert (freq - expected).abs().max() < 0.03 and freq[[1, 2, 4]].sum() == 0


def test_logprobs_are_raw_and_top_sorted():
    torch.manual_seed(5)
    logits = torch.randn(3, 30) * 2
    params = [SamplingParams(temperature=0.5, top_k=3, logprobs=5),
              SamplingParams(temperature=0.0, logprobs=0),
              SamplingParams(top_p=0.3)]
    out = Sampler().sample(logits, params, _gens([1, 2, 3]))
    raw = logits.log_softmax(dim=-1)
    for r, t in enumerate(out.token_ids):
        assert math.isclose(out.logprobs[r], raw[r, t].item(), rel_tol=1e-6, abs_tol=1e-6)
    top = out.top_logprobs[0]
    assert len(top) == 5
    vals = [v for _, v in top]
    assert vals == sorted(vals, reverse=True)
    ref_vals, ref_ids = raw[0].topk(5)
    assert [i for i, _ in top] == ref_ids.tolist()
    assert torch.allclose(torch.tensor(vals), ref_vals)
    assert out.top_logprobs[1] is None and out.top_logprobs[2] is None


def test_sample_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="len"):
        Sampler().sample(torch.zeros(2, 5), [SamplingParams()], [None, None])


def test_top_k_past_int64_is_off():
    logits = torch.randn(3, 50)
    huge, off = Sampler().keep_mask(logits, [SamplingParams(top_k=10 ** 22)] * 3), Sampler().keep_mask(
        logits, [SamplingParams()] * 3)
    assert torch.equal(huge, off)
