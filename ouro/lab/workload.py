"""The synthetic requests every scenario sends: seeded token prompts of a fixed length."""

from __future__ import annotations

import random

PROMPT_LEN, MAX_TOKENS = 48, 8   # serve_scenarios.py's defaults say 8 too


def prompts(n: int, length: int = PROMPT_LEN, vocab: int = 300, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]
