"""The engine's greedy outputs under forced preemption against transformers, request by request.

    python benchmarks/preemption_agreement.py --model tiny
    python benchmarks/preemption_agreement.py --model small --num-prompts 8 --max-prompt-len 700 --pages 52 --slots 2

The cache budget buys about `--pages` pages of 16 tokens and `--slots` KDA state slots (the memory
planner caps slots at half the budget and gives the rest to pages; what it made is printed):
enough for any one request, far too few for all of them at once, so the scheduler must preempt
(and recompute) while requests arrive and prefill in chunks. Each request's tokens are compared
with transformers' `generate` on that request alone. A `small` state slot costs as much as 26
pages, so there few slots and long prompts are needed for pages to run out. Exits non-zero if no
preemption happened (the run would prove nothing) or an output differs.
"""

from __future__ import annotations

import argparse
import os
import random
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from ouro.config import EngineConfig  # noqa: E402
from ouro.engine.llm_engine import LLMEngine  # noqa: E402
from ouro.engine.sampling import SamplingParams  # noqa: E402
from ouro.layers.context import ModelCache  # noqa: E402
from ouro.models.loader import load_model  # noqa: E402
from ouro.models.resolve import resolve_model  # noqa: E402

PAGE = 16


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--pages", type=int, default=14, help="pages the budget is sized for")
    ap.add_argument("--slots", type=int, default=8, help="KDA state slots the budget is sized for")
    ap.add_argument("--max-prompt-len", type=int, default=128, help="prompts are 5 to this many tokens")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    from transformers import Glm5NextForConditionalGeneration
    from transformers.utils import logging
    logging.set_verbosity_error()
    directory = resolve_model(a.model, progress=False)
    model = load_model(directory)
    c = model.config
    rng = random.Random(a.seed)
    prompts = [[rng.randrange(c.vocab_size) for _ in range(rng.randrange(5, a.max_prompt_len))]
               for _ in range(a.num_prompts)]
    budget = a.pages * PAGE * ModelCache.bytes_per_token(c) + a.slots * ModelCache.bytes_per_slot(c)
    cfg = EngineConfig(page_size=PAGE, max_memory=budget, max_num_seqs=a.num_prompts, max_num_batched_tokens=48)
    engine = LLMEngine(model, None, cfg, verbose=False)
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    ids, finished, step = [], {}, 0
    while len(ids) < len(prompts) or engine.has_unfinished():
        if len(ids) < len(prompts) and step % 2 == 0:     # arrivals interleaved with decoding
            ids.append(engine.add_request({"prompt_token_ids": prompts[len(ids)]}, params))
        finished.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        step += 1

    hf = Glm5NextForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).eval()
    same = 0
    for rid, p in zip(ids, prompts):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=a.max_tokens, min_new_tokens=a.max_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        same += finished[rid] == ref
        if finished[rid] != ref:
            at = next(j for j, (x, y) in enumerate(zip(finished[rid], ref)) if x != y)
            print(f"  {rid} ({len(p)}-token prompt) parts at output token {at}")
    n_pre = engine.scheduler.num_preemptions
    print(f"{a.model}: {same}/{len(prompts)} requests identical to transformers token for token "
          f"({a.max_tokens} greedy tokens each); {n_pre} preemptions; cache of {engine.plan.n_pages} pages of "
          f"{PAGE} tokens and {engine.plan.n_slots} state slots; "
          f"pools back to full: {engine.pages.num_free == engine.pages.num_total}")
    if n_pre == 0:
        print("no preemption happened, so this run shows nothing about it: raise --max-prompt-len or lower --pages")
    return 0 if n_pre > 0 and same == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())
