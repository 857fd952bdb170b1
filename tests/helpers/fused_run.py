"""One engine run of the fused-step tests: greedy tokens and logits of every prompt, arrivals while
others decode (`native/test_fused_step.py`, `native/test_native_kda.py`,
`quant/test_experts_fused.py`)."""

from __future__ import annotations

import torch

from ouro.config import EngineConfig
from ouro.engine.llm_engine import LLMEngine
from ouro.engine.sampling import SamplingParams
from ouro.models.loader import load_model


def run(checkpoint, prompts, mode: dict, tokens: int = 10, max_memory: int = 6 << 20):
    """A fresh model each run: quantisation replaces the modules of the model it is given."""
    model = load_model(checkpoint)
    cfg = EngineConfig(page_size=16, max_memory=max_memory, max_num_seqs=8, max_num_batched_tokens=48,
                       dtype="float32", **mode)
    engine = LLMEngine(model, None, cfg, verbose=False, record_logits=True)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    ids, finished, steps = [], {}, 0
    while len(ids) < len(prompts) or engine.has_unfinished():
        if len(ids) < len(prompts) and steps % 2 == 0:     # arrivals while others decode
            ids.append(engine.add_request({"prompt_token_ids": prompts[len(ids)]}, params))
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        steps += 1
    out = [(finished[r].token_ids, torch.stack(engine.logits_history[r])) for r in ids]
    engine.close()
    return out
