"""Checkpoints transformers runs whose layout the two reference shapes do not have, served by the
engine (its memory plan, product picks, quantisation and fused ops, not only the model): a model
with no sparse-attention layer (no per-token cache rows: a page costs 0 bytes) and one with no
shared experts (transformers saves zero-width shared tensors). Greedy tokens and logits against
transformers, in float32 and under W8A8 against the float32 engine."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.fused_run import run
from tests.helpers.numerics import rel_rms
from ouro.engine.memory import plan_memory
from ouro.lab.reference.checkpoint import KDA, make_hf_checkpoint
from ouro.lab.reference.compare import reference_run
from ouro.models.loader import load_model

LAYOUTS = {"no sparse attention": dict(layer_types=[KDA] * 4), "no shared experts": dict(n_shared_experts=0)}
PROMPT = list(range(3, 60))


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request, tmp_path_factory):
    from transformers import Glm5NextForConditionalGeneration
    d = tmp_path_factory.mktemp("layout")
    make_hf_checkpoint("tiny", d, **LAYOUTS[request.param])
    hf = Glm5NextForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    return request.param, d, reference_run(hf, torch.tensor(PROMPT), 6)


def test_the_engine_serves_it_as_transformers_does(layout):
    name, d, ref = layout
    (tokens, logits), = run(d, [PROMPT], {}, tokens=7)
    assert tokens[:6] == ref.tokens, name
    assert not logits.isnan().any()
    assert rel_rms(logits[1:7], ref.decode) <= 1e-5, name      # the steps after the prefill's token
    (q_tokens, q_logits), = run(d, [PROMPT], {"quantization": "w8a8"}, tokens=7)
    assert not q_logits.isnan().any() and rel_rms(q_logits, logits) <= 0.1, name


def test_pages_of_a_model_without_per_token_rows_cost_nothing_and_cover_every_sequence():
    model = load_model_config(layer_types=[KDA] * 4)
    plan = plan_memory(model, 1 << 20, page_size=16, max_num_seqs=3, max_model_len=100)
    assert plan.page_bytes == 0 and plan.n_pages == 3 * 7       # 3 sequences of ceil(100 / 16) pages
    assert plan.n_slots == 3


def load_model_config(**overrides):
    import dataclasses

    from ouro.models.presets import PRESETS
    return dataclasses.replace(PRESETS["tiny"], **{k: tuple(v) for k, v in overrides.items()})
