"""Under deterministic inference (`--enable-deterministic-inference`, batch-invariant kernels) the
speculative run is the plain run bit for bit: the KDA state a verification commits equals the one
the same tokens leave as decode steps, and every logprob of a K = 3 speculative run equals the
plain run's, at batch 6 and at batch 1."""

from __future__ import annotations

import pytest
import torch

from ouro.engine.llm import LLM
from ouro.engine.sampling import SamplingParams
from ouro.ops import batch_invariant

from tests.helpers.speculative_steps import PROMPTS, _decoded, _state, _verify


@pytest.fixture(scope="module")
def deterministic():
    kw = dict(max_memory=128 << 20, page_size=16, enable_deterministic_inference=True)
    yield LLM("tiny-py", **kw), LLM("tiny-py", speculative_config={"num_speculative_tokens": 3}, **kw)
    batch_invariant.disable()


@pytest.mark.parametrize("p", range(len(PROMPTS)))
def test_replayed_state_equals_the_decoded_one_bit_for_bit(deterministic, p):
    plain = deterministic[0]
    prompt = plain.engine.tokenizer.encode(PROMPTS[p]).ids
    for m in (1, 2, 3, 4):
        cache, slot, rec, start, inputs = _verify(plain, prompt, [30, 31, 32], "replay")
        before = _state(cache, slot)
        rec.commit(cache, slot, m)
        replayed = _state(cache, slot)
        decoded = _decoded(plain, cache, slot, before, inputs[:m], start)
        assert torch.equal(replayed[0], decoded[0]) and torch.equal(replayed[1], decoded[1]), (p, m)


def test_speculative_logprobs_equal_the_plain_run_bit_for_bit(deterministic):
    plain, spec = deterministic
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)
    lp = lambda llm, prompts: [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]
    batched = lp(plain, PROMPTS)
    assert lp(spec, PROMPTS) == batched                                   # K=3 drafts, verified and replayed
    assert [lp(plain, [p])[0] for p in PROMPTS] == batched               # batch 1 against batch 6
    assert spec.engine.stats()["spec_accept_length"] > 1.0
