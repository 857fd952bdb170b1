"""Give every constant-initialised tensor of a random transformers glm5_next text model random
values, so a comparison against it checks every weight.

transformers initialises many tensors to a constant (RMSNorm weights 1, hyper-connection scale 1
and base 0, A_log 0 under the bounded gate, the k-pool ape 0 and gate 1, LayerNorm weight 1 and
bias 0, the router correction bias 0): an implementation that ignored any of them would still
match. Tensors are found generically (all elements equal) and randomised by a rule chosen by
name; a constant tensor no rule covers fails loudly, so a future constant-initialised weight is
caught rather than silently left unchecked.
"""

from __future__ import annotations

import math
import re

import torch

TEXT_PREFIXES = ("model.language_model.", "lm_head.")


def _uniform(lo, hi):
    return lambda shape, g, t: torch.empty(shape).uniform_(lo, hi, generator=g)


def _normal(std):
    return lambda shape, g, t: torch.empty(shape).normal_(0.0, std, generator=g)


def _gate(shape, g, t):
    # k-pool compress gate [d, D]: gate logits x @ W^T of order 0.5 for unit-scale x
    return torch.empty(shape).normal_(0.0, 0.5 / math.sqrt(shape[-1]), generator=g)


def _hc_base(shape, g, t):
    # [pre n, post n, comb n*n]: N(0, 0.5), and the comb logits 10 higher on and above the diagonal.
    # Sinkhorn then converges slowly (an almost triangular matrix), so its iteration count matters:
    # one iteration more or fewer moves comb by ~1e-3 instead of ~1e-8.
    n = round(math.sqrt(1 + shape[0])) - 1
    base = torch.empty(shape).normal_(0.0, 0.5, generator=g)
    base[2 * n:] += 10.0 * torch.ones(n, n).triu().flatten()
    return base


# (pattern on the full name, sampler); the first match wins
RULES = [
    (r"\.A_log$", _uniform(-1.0, 1.0)),                       # decay rate exp(A_log) in (0.37, 2.7)
    (r"hc\.scale$", _uniform(0.5, 1.5)),
    (r"hc\.base$", _hc_base),
    (r"index_kpool_compress_ape$", _normal(1.0)),
    (r"index_kpool_compress_gate$", _gate),
    (r"e_score_correction_bias$", _normal(0.05)),
    (r"norm\.bias$", _normal(0.1)),                           # LayerNorm bias (indexer k_norm)
    (r"(norm|layernorm)\.weight$", _uniform(0.5, 1.5)),       # RMSNorm, gated RMSNorm, LayerNorm
]


def text_tensors(model):
    """Name -> tensor for every parameter and buffer of the text model (vision tower excluded)."""
    named = dict(model.named_parameters())
    named.update(dict(model.named_buffers()))
    return {n: t for n, t in named.items() if n.startswith(TEXT_PREFIXES)}


def constant_tensors(model) -> list[str]:
    """Names of text-model tensors (more than one element) whose elements are all equal."""
    return [n for n, t in text_tensors(model).items()
            if t.numel() > 1 and t.is_floating_point() and bool((t == t.flatten()[0]).all())]


@torch.no_grad()
def randomize_constants(model, seed: int = 0) -> list[str]:
    """Replace every constant text-model tensor by random values from its rule. Returns the names
    changed. Raises AssertionError if a constant tensor has no rule or any stays constant."""
    g = torch.Generator().manual_seed(seed + 12345)
    changed, missing = [], []
    for name in sorted(constant_tensors(model)):
        t = text_tensors(model)[name]
        rule = next((fn for pat, fn in RULES if re.search(pat, name)), None)
        if rule is None:
            missing.append(f"{name} {list(t.shape)} = {float(t.flatten()[0])}")
            continue
        t.copy_(rule(tuple(t.shape), g, t).to(t.dtype))
        changed.append(name)
    assert not missing, "constant-initialised tensors with no randomisation rule (add one to RULES):\n  " + \
        "\n  ".join(missing)
    left = constant_tensors(model)
    assert not left, f"tensors still constant after randomisation: {left}"
    return changed
