"""The trained built-in model `tiny-py` (the default of generate/serve/eval): it is the preset's
shape, ouro and transformers agree on it token for token, and prefix caching is exact on it.
A trained model has a real distribution, so agreement is checked where near-ties are rare and
continuations are long (200 tokens), unlike random weights."""

import pytest
import torch

from ouro.config import ModelConfig
from ouro.eval.corpus import load_split
from ouro.models.presets import BUILTIN_DIR, PRESETS, make_model
from ouro.models.resolve import load_tokenizer, resolve_model

pytest.importorskip("transformers")

DIR = BUILTIN_DIR / "tiny-py"
PROMPT = '''import os


class Cache:
    """A small cache of open files."""

    def __init__(self, root):
        self.root = root
'''


@pytest.fixture(scope="module")
def hf():
    from transformers import Glm5NextForConditionalGeneration
    from transformers.utils import logging
    logging.set_verbosity_error()     # the MTP layer's tensors are "unexpected" to transformers
    return Glm5NextForConditionalGeneration.from_pretrained(DIR, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(DIR)


def test_shipped_model_is_the_preset_with_an_mtp_layer(tmp_path):
    assert resolve_model("tiny-py") == DIR
    shipped = ModelConfig.from_hf(DIR)
    assert shipped.has_mtp and shipped == PRESETS["tiny-py"].__class__(**{**PRESETS["tiny-py"].__dict__, "has_mtp": True})
    from ouro.models.loader import load_model, load_weights
    ignored = load_weights(load_model(DIR), DIR)
    assert ignored["mtp"] > 20 and ignored["vision"] > 0
    with pytest.raises(ValueError, match="trained model shipped"):
        make_model("tiny-py", tmp_path / "x")


def test_greedy_200_tokens_agree_with_transformers(hf, tok):
    from ouro.lab.reference.compare import reference_run
    from ouro.engine.llm import LLM
    from ouro.engine.sampling import SamplingParams
    ids = tok.encode(PROMPT, add_special_tokens=False).ids
    ref = reference_run(hf, ids, n_decode=200)
    llm = LLM(str(DIR), dtype="float32", max_memory=64 << 20, page_size=16)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))[0]
    theirs = [int(ref.prefill[-1].argmax())] + [int(r.argmax()) for r in ref.decode[:-1]]
    assert out.token_ids == theirs
    assert len(set(theirs)) > 20          # a real continuation, not one token repeated


def test_prefix_cache_hit_equals_cold_run(tok):
    from ouro.engine.llm import LLM
    from ouro.engine.sampling import SamplingParams
    doc = load_split("held_out", max_bytes=4000)[0].text
    shared = tok.encode(doc, add_special_tokens=False).ids[:150]
    q1 = tok.encode("\n\ndef first(x):\n", add_special_tokens=False).ids
    q2 = tok.encode("\n\nclass Second:\n    def run(self):\n", add_special_tokens=False).ids
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    warm = LLM(str(DIR), dtype="float32", max_memory=64 << 20, page_size=16, enable_prefix_caching=True)
    a = warm.generate([shared + q1], greedy)[0]
    b = warm.generate([shared + q2], greedy)[0]
    cold = LLM(str(DIR), dtype="float32", max_memory=64 << 20, page_size=16).generate([shared + q2], greedy)[0]
    assert a.cached_tokens == 0 and b.cached_tokens >= 128
    assert b.token_ids == cold.token_ids


# bfloat16 runs at ~1 GFLOP/s on an AVX2-only CPU: slow (its logits are checked in test_bf16_vs_transformers)
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_held_out_bits_per_byte_ouro_equals_transformers(dtype, tok):
    """The yardstick on the shipped model: ouro's engine and transformers on the same windows.
    float32 agrees to fp32 noise; bfloat16 differs by rounding, and both show a learned model."""
    from ouro.engine.llm import LLM
    from ouro.eval.ppl import evaluate_bits_per_byte, transformers_bits_per_byte
    docs = load_split("held_out", max_bytes=12_000)
    llm = LLM(str(DIR), dtype=dtype, max_memory=64 << 20, page_size=16)
    mine = evaluate_bits_per_byte(llm, tok, docs, context_len=512, progress=False)
    theirs = transformers_bits_per_byte(DIR, tok, docs, context_len=512, dtype=dtype)
    assert mine.n_bytes == theirs.n_bytes and mine.n_tokens == theirs.n_tokens
    tol = 1e-5 if dtype == "float32" else 2e-2
    assert abs(mine.bits_per_byte - theirs.bits_per_byte) <= tol * theirs.bits_per_byte
    assert mine.bits_per_byte < 2.6     # untrained: ~3.6 (11 bits/token over ~3 bytes/token)


def test_a_mis_shaped_mtp_head_is_named(tmp_path):
    import shutil
    from safetensors.torch import load_file, save_file
    from ouro.config import CheckpointError
    from ouro.models.loader import load_model
    for f in DIR.iterdir():
        shutil.copy(f, tmp_path / f.name)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.language_model.layers.4.eh_proj.weight"
    tensors[name] = tensors[name][:, :10].contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"MTP tensor .*layers\.4\.eh_proj\.weight has shape \[192, 10\]"):
        load_model(tmp_path)


@pytest.mark.processes
def test_ouro_serve_default_model_continues_python(tmp_path):
    """The README's main job: `ouro serve` with no --model serves the trained tiny-py."""
    import httpx
    from tests.helpers.serve_helpers import Server
    s = Server("tiny-py", tmp_path=tmp_path)
    try:
        models = httpx.get(s.base + "/v1/models", timeout=10).json()
        assert models["data"][0]["id"] == "tiny-py"
        r = httpx.post(s.base + "/v1/completions", timeout=120, json={
            "prompt": "import os\n\n\ndef main(", "max_tokens": 48, "temperature": 0}).json()
        text = r["choices"][0]["text"]
        code_shaped = any(ch in text for ch in "():") and "\n" in text    # not byte noise
        assert code_shaped and r["usage"]["completion_tokens"] > 10, text
    finally:
        s.stop()
