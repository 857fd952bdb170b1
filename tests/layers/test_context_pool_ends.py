"""ForwardContext.pool_ends (host-side, no device read) equals the device formula it replaced."""

import random

import torch

from ouro.layers.context import ForwardContext, ModelCache
from ouro.models.presets import PRESETS


def test_pool_ends_match_the_device_formula_on_random_batches():
    cache = ModelCache(PRESETS["tiny"], 4, 64, 16)
    rng = random.Random(0)
    for _ in range(200):
        B = rng.randint(1, 4)
        ql, sp = [rng.randint(1, 20) for _ in range(B)], [rng.randint(0, 40) for _ in range(B)]
        ctx = ForwardContext.build(cache, ql, sp, list(range(B)), torch.arange(B * 16).view(B, 16))
        for kpool in (1, 2, 4, 5):
            want = ((ctx.positions + 1) % kpool == 0).nonzero().flatten()
            got = ctx.pool_ends(kpool)
            assert torch.equal(want, torch.empty(0, dtype=torch.long) if got is None else got), (ql, sp, kpool)
