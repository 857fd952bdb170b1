"""ouro in bfloat16 is no less precise than transformers in bfloat16, both measured against
transformers in float32 on the same tokens (see ouro/lab/reference/bf16.py for why errors are pooled over prompts)."""

import re

import pytest
import torch

from ouro.lab.reference.bf16 import PAIRS, bf16_errors
from ouro.models.loader import load_model

OURS, THEIRS, _ = PAIRS
FACTOR = 1.1


def bf16_pair(hf_pair, shape):
    from transformers import Glm5NextForConditionalGeneration
    d, hf32, _ = hf_pair(shape)
    hf16 = Glm5NextForConditionalGeneration.from_pretrained(d, dtype=torch.bfloat16).eval()
    return hf32, hf16, load_model(d, dtype=torch.bfloat16)


def test_float32_tensors_survive_a_bfloat16_cast(hf_pair):
    """Router, correction bias, conv kernels, A_log / dt_bias and mHC base / scale stay float32 with
    the checkpoint's exact values (as transformers keeps them); everything else is bfloat16."""
    d, _, fp32 = hf_pair("tiny")
    bf16 = load_model(d, dtype=torch.bfloat16)
    keep = r"(gate\.weight|e_score_correction_bias|_conv1d\.weight|A_log|dt_bias|hc\.base|hc\.scale)$"
    ref = fp32.state_dict()
    for name, t in bf16.state_dict().items():
        if re.search(keep, name):
            assert t.dtype == torch.float32 and torch.equal(t, ref[name]), name
        else:
            assert t.dtype == torch.bfloat16, name


@pytest.mark.parametrize("shape", ["tiny", "shared"])
def test_bf16_prefill_error_no_worse_than_transformers(hf_pair, shape):
    e = bf16_errors(*bf16_pair(hf_pair, shape), n_prompts=8, prompt_len=300, n_decode=0)["prefill"]
    assert 1e-3 < e[THEIRS] < 0.3, e  # bf16 really ran, and sanely
    assert e[OURS] <= FACTOR * e[THEIRS], e


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["tiny", "shared"])
def test_bf16_decode_error_no_worse_than_transformers(hf_pair, shape):
    e = bf16_errors(*bf16_pair(hf_pair, shape), n_prompts=32, prompt_len=100, n_decode=16)["decode"]
    assert 1e-3 < e[THEIRS] < 0.3, e
    assert e[OURS] <= FACTOR * e[THEIRS], e
