"""bfloat16 error of ouro and of transformers against transformers in float32, on the same tokens.

Each prompt is run as a prefill, then decode steps fed float32 transformers' greedy tokens (so
all three models see the same inputs). Errors are rel RMS over all prompts' logits together: with
random weights a few rows per prompt change their sparse selection under bf16 noise, and those
rows dominate the error, so one prompt alone says little about which side is more precise.
"""

from __future__ import annotations

import torch

from .compare import ouro_run, reference_run, rel_rms

PAIRS = ("ouro-bf16 vs fp32", "transformers-bf16 vs fp32", "ouro-bf16 vs transformers-bf16")


def load_three(directory):
    from transformers import Glm5NextForConditionalGeneration

    from ...models.loader import load_model
    hf32 = Glm5NextForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).eval()
    hf16 = Glm5NextForConditionalGeneration.from_pretrained(directory, dtype=torch.bfloat16).eval()
    return hf32, hf16, load_model(directory, dtype=torch.bfloat16)


def bf16_errors(hf32, hf16, ouro16, n_prompts: int, prompt_len: int, n_decode: int, seed: int = 0) -> dict:
    """{"prefill": {pair: err}, "decode": {pair: err}} over `n_prompts` random prompts."""
    logits = {phase: {k: [] for k in ("fp32", "hf16", "ouro16")} for phase in ("prefill", "decode")}
    g = torch.Generator().manual_seed(seed)
    for _ in range(n_prompts):
        ids = torch.randint(0, ouro16.config.vocab_size, (prompt_len,), generator=g)
        r32 = reference_run(hf32, ids, n_decode)
        r16 = reference_run(hf16, ids, tokens=r32.tokens)
        prefill, decode = ouro_run(ouro16, r32)
        phases = (("prefill", (r32.prefill, r16.prefill, prefill)), ("decode", (r32.decode, r16.decode, decode)))
        for phase, runs in phases:
            for key, t in zip(("fp32", "hf16", "ouro16"), runs):
                logits[phase][key].append(t)
    out = {}
    for phase, d in logits.items():
        fp32, hf16_, ours = (torch.cat(d[k]) for k in ("fp32", "hf16", "ouro16"))
        out[phase] = dict(zip(PAIRS, (rel_rms(ours, fp32), rel_rms(hf16_, fp32), rel_rms(ours, hf16_))))
    return out
