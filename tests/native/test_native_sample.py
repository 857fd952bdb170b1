"""Sampling's pick and its logprob as one native op (`ouro/native/sample.cpp`) against torch's form
(`Sampler.picks_reference`: max(dim), log_softmax, gather) and a float64 log-softmax, on every path
this machine runs: the same ids (first maximum, first NaN, ties to the lowest id), logprobs to float32
rounding, NaN and infinity where torch gives them, rows independent of their batch."""

import contextlib
import math

import pytest
import torch

from ouro.engine.sampling import Sampler, SamplingParams, make_generator
from ouro.native import kernels
from ouro.native import sample as ns


@pytest.fixture(autouse=True)
def built():
    assert kernels.load("sample"), kernels.why_not("sample")


def path_of(path):
    return kernels.portable("sample") if path == "portable" else contextlib.nullcontext()


def reference(x, chosen):
    return Sampler.picks_reference(x, chosen.tolist())


def check(x, chosen, path):
    with path_of(path):
        ids, lp = ns.pick_logprobs(x, chosen)
    ref_ids, ref_lp = reference(x, chosen)
    assert ids.tolist() == ref_ids
    exact = torch.log_softmax(x.double(), -1).gather(-1, ids[:, None])[:, 0]
    ref_lp = torch.tensor(ref_lp, dtype=torch.float64)
    for got, want, t in zip(lp.double().tolist(), exact.tolist(), ref_lp.tolist()):
        if math.isnan(want) or math.isnan(t):
            assert math.isnan(got) and math.isnan(t), (got, want, t)
        elif math.isinf(want):
            assert got == want == t
        else:       # float32 rounding: no further from float64 than torch's own float32 path, plus a few ulp
            assert abs(got - want) <= 2 * abs(t - want) + 4e-7 * max(1.0, abs(want)), (got, want, t)
    return ids, lp


@pytest.mark.parametrize("path", ["native", "portable"])
@pytest.mark.parametrize("V", [1, 7, 8, 9, 17, 33, 1000, 32005])
@pytest.mark.parametrize("B", [1, 3, 16, 64])
def test_picks_and_logprobs_equal_torch(path, V, B):
    g = torch.Generator().manual_seed(B * 1000 + V)
    x = torch.randn(B, V, generator=g) * (1 + 4 * torch.rand(B, 1, generator=g))
    chosen = torch.randint(0, V, (B,), generator=g)
    chosen[torch.rand(B, generator=g) < 0.5] = -1         # greedy rows beside rows with a drawn id
    check(x, chosen, path)
    check(x, torch.full((B,), -1), path)


@pytest.mark.parametrize("path", ["native", "portable"])
def test_ties_go_to_the_lowest_id_wherever_they_sit(path):
    V = 45      # five 8-lane blocks and a tail
    rows = []
    for a, b in [(0, 44), (3, 11), (8, 16), (40, 42), (7, 8), (44, 43), (20, 21)]:
        r = torch.randn(V)
        r[a] = r[b] = r.max() + 1
        rows.append(r)
    x = torch.stack(rows)
    ids, _ = check(x, torch.full((len(rows),), -1), path)
    assert ids.tolist() == [0, 3, 8, 40, 7, 43, 20]


@pytest.mark.parametrize("path", ["native", "portable"])
def test_nan_and_infinite_rows_as_torch_gives_them(path):
    V = 37
    x = torch.randn(9, V)
    x[0, 5] = x[0, 30] = float("nan")            # the first NaN is the pick, every logprob NaN
    x[1, 36] = float("nan")                      # in the tail
    x[2, 12] = float("inf")                      # +inf: torch's log-softmax is NaN everywhere
    x[3] = float("-inf")                         # every value -inf: id 0, NaN
    x[4, :30] = float("-inf")                    # -inf beside finite values: a chosen -inf is -inf
    x[5, 9] = x[5, 20] = float("inf")
    x[6] = 0.0                                   # all equal: id 0, -log(V)
    x[7] = torch.linspace(-1e4, 10, V)           # terms far below e^-87 add nothing
    x[8] = 88.0 + torch.rand(V)                  # large logits: no overflow, the max is subtracted first
    chosen = torch.tensor([-1, 3, -1, -1, 2, -1, -1, -1, 4])
    ids, lp = check(x, chosen, path)
    assert ids[:3].tolist() == [5, 3, 12] and lp[:4].isnan().all()
    assert lp[4].item() == float("-inf")
    assert abs(lp[6].item() + math.log(V)) < 1e-6


@pytest.mark.parametrize("path", ["native", "portable"])
def test_a_row_does_not_depend_on_its_batch_or_its_stride(path):
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(16, 3000, generator=g) * 3
    x = wide[:, :2999]                           # rows strided 3000 apart
    chosen = torch.full((16,), -1)
    with path_of(path):
        ids, lp = ns.pick_logprobs(x, chosen)
        for b in range(16):
            one_id, one_lp = ns.pick_logprobs(x[b:b + 1].contiguous(), chosen[:1])
            assert one_id.item() == ids[b].item() and torch.equal(one_lp, lp[b:b + 1])   # bit for bit
    check(x, chosen, path)


def test_bad_inputs_are_refused():
    x = torch.randn(2, 10)
    with pytest.raises(RuntimeError, match="outside"):
        ns.pick_logprobs(x, torch.tensor([-1, 10]))
    with pytest.raises(RuntimeError, match="outside"):
        ns.pick_logprobs(x, torch.tensor([-2, 0]))
    with pytest.raises(RuntimeError, match="float32"):
        ns.pick_logprobs(x.double(), torch.tensor([-1, 0]))
    with pytest.raises(RuntimeError, match="int64"):
        ns.pick_logprobs(x, torch.tensor([-1]))
    with pytest.raises(RuntimeError, match="contiguous rows"):
        ns.pick_logprobs(x.t(), torch.tensor([-1] * 10))


def test_the_sampler_gives_torchs_tokens_and_logprobs_through_the_op():
    """Greedy, seeded and top-logprob rows in one batch: the same tokens and top entries with the op
    and with every fused kernel off, chosen logprobs to float32 rounding; the op ran (a bad pick
    planted in it shows)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 500, generator=g) * 2
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=1, logprobs=3),
              SamplingParams(temperature=0, logprobs=5), SamplingParams(temperature=1.0, top_k=20, seed=2),
              SamplingParams(temperature=0.5, top_p=0.9, seed=3), SamplingParams(temperature=0)]

    def run():
        gens = [make_generator(p.seed, i) for i, p in enumerate(params)]
        with torch.inference_mode():
            return Sampler().sample(logits, params, gens)

    fused = run()
    with kernels.eager_only():
        eager = run()
    assert fused.token_ids == eager.token_ids
    assert fused.top_logprobs == eager.top_logprobs
    assert max(abs(a - b) for a, b in zip(fused.logprobs, eager.logprobs)) < 1e-5

    calls = []
    real = ns.pick_logprobs
    try:
        ns.pick_logprobs = lambda x, c: (calls.append(1), real(x, c))[1]
        run()
        assert calls, "the sampler did not take the native op"
        ns.pick_logprobs = lambda x, c: (real(x, c)[0] + 1, real(x, c)[1])       # a bad pick
        assert run().token_ids != eager.token_ids
    finally:
        ns.pick_logprobs = real
