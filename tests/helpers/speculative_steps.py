"""The speculative tests' prompts and the KDA state a verification commits against the one the same
tokens leave as decode steps (`engine/test_speculative.py`, `engine/test_speculative_deterministic.py`,
`engine/test_tp_engine.py`)."""

from __future__ import annotations

import torch

from ouro.engine.speculative import KDARecord


PROMPTS = ["def add(a, b):\n    return", "import os\nimport sys\n\n\ndef main():\n",
           "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
           "for i in range(10):\n    if i % 2 == 0:\n", "    def __repr__(self):\n        return f\"",
           "with open(path) as f:\n    for line in f:\n"]


def _verify(llm, prompt_ids, drafts, mode):
    """Run the trunk over a prompt, then one verification of `drafts` after its last token with
    KDA records of `mode`; returns (cache, slot, record, the verification's inputs)."""
    from ouro.layers.context import ForwardContext
    eng = llm.engine
    cache = eng.runner.cache
    slot, pages = 0, list(range(8))
    model = eng.model
    with torch.inference_mode():
        ctx = ForwardContext.build(cache, [len(prompt_ids) - 1], [0], [slot], [pages])
        model(torch.tensor(prompt_ids[:-1]), ctx)
        start = len(prompt_ids) - 1
        rec = KDARecord(mode)
        inputs = [prompt_ids[-1]] + drafts
        ctx = ForwardContext.build(cache, [len(inputs)], [start], [slot], [pages], logits="all")
        ctx.replay = {0: rec}
        model(torch.tensor(inputs), ctx)
    return cache, slot, rec, start, inputs


def _decoded(llm, cache, slot, before, tokens, start):
    """The state after `tokens` run as decode steps one at a time from `before`."""
    from ouro.layers.context import ForwardContext
    cache.conv[:, slot], cache.recurrent[:, slot] = before
    with torch.inference_mode():
        for i, tok in enumerate(tokens):
            ctx = ForwardContext.build(cache, [1], [start + i], [slot], [list(range(8))])
            llm.engine.model(torch.tensor([tok]), ctx)
    return _state(cache, slot)


def _state(cache, slot):
    return cache.conv[:, slot].clone(), cache.recurrent[:, slot].clone()
