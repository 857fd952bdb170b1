"""Config options beyond the two reference shapes, each compared with transformers on a checkpoint
transformers saved (prefill logits of a 250-token prompt and greedy decode steps), or refused at
load with a message naming the option."""

import dataclasses

import pytest
import torch
from safetensors import safe_open

from ouro.config import CheckpointError, ModelConfig
from ouro.lab.reference.checkpoint import make_hf_checkpoint
from ouro.lab.reference.compare import compare, reference_run
from ouro.lab.reference.options import OPTIONS
from ouro.models.glm5_next import Glm5NextModel
from ouro.models.loader import load_model, load_weights

PROMPT, DECODE = 250, 4
# options whose value is not visible in tensor shapes: the same weights with the default must differ
DEFAULTS = {"linear_lower_bound=null": dict(linear_lower_bound=-5.0), "norm_topk_prob=false": dict(norm_topk_prob=True)}


def prompt(vocab):
    return torch.randint(0, vocab, (PROMPT,), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("name", list(OPTIONS))
def test_option_matches_transformers(name, tmp_path):
    from transformers import Glm5NextForConditionalGeneration
    options = OPTIONS[name]
    make_hf_checkpoint("tiny", tmp_path, **options)
    hf = Glm5NextForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32).eval()
    model = load_model(tmp_path)
    for key, value in options.items():
        assert getattr(model.config, key) == value
    ref = reference_run(hf, prompt(model.config.vocab_size), DECODE)
    result = compare(model, ref)
    assert result.passes(), f"{name}: {result}"
    if name == "tie_word_embeddings":  # the head must come from the embedding, not from the file
        with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
            assert "lm_head.weight" not in f.keys()
    if name in DEFAULTS:
        other = Glm5NextModel(dataclasses.replace(model.config, **DEFAULTS[name]))
        load_weights(other, tmp_path)
        assert not compare(other.eval(), ref).passes(), f"{name}: the option made no difference"


@pytest.fixture(scope="module")
def tiny_reference(hf_pair):
    d, hf, model = hf_pair("tiny")
    return d, reference_run(hf, prompt(model.config.vocab_size), DECODE)


@pytest.mark.parametrize("chunk", [1, 5, 8, 12, 32, 64])
def test_kda_chunk_size_matches_transformers(tiny_reference, chunk):
    d, ref = tiny_reference
    result = compare(load_model(d, kda_chunk_size=chunk), ref)
    assert result.passes(), f"kda_chunk_size={chunk}: {result}"


def test_tail_off_is_refused(tmp_path):
    make_hf_checkpoint("tiny", tmp_path, index_kpool_always_select_tail=False)
    with pytest.raises(CheckpointError, match="index_kpool_always_select_tail=false is not supported.*backend"):
        load_model(tmp_path)


def test_other_activation_is_refused():
    with pytest.raises(CheckpointError, match="hidden_act 'gelu'"):
        ModelConfig.from_dict({"hidden_act": "gelu", "num_hidden_layers": 4})


def test_a_near_tie_counts_as_the_same_choice_and_a_real_miss_does_not():
    from ouro.lab.reference.compare import same_choice
    theirs = torch.tensor([0.5, 2.0, 2.0 - 1.8e-7, -1.0])
    assert same_choice(torch.tensor([0.0, 1.0, 0.9, 0.0]), theirs)
    assert same_choice(torch.tensor([0.0, 0.9, 1.0, 0.0]), theirs)        # ouro picks the near-tied one
    assert not same_choice(torch.tensor([1.0, 0.9, 0.0, 0.0]), theirs)    # 1.5 below: a real miss
