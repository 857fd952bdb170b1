"""Run transformers and ouro on the same tokens and compare them: prefill logits of a prompt, then
greedy decode steps (transformers with its own cache, ouro with its recurrent/absorbed decode
path, both fed transformers' greedy tokens). Also: where the two models' sparse selections differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...engine.simple_runner import SimpleRunner

TOL = 1e-4


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS error of a against reference b; NaN anywhere counts as infinitely wrong."""
    a, b = a.double(), b.double()
    if torch.isnan(a).any() or torch.isnan(b).any():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@dataclass
class Reference:
    ids: list[int]
    prefill: torch.Tensor      # [L, V] logits of every prompt token
    tokens: list[int]          # greedy tokens fed as decode steps
    decode: torch.Tensor       # [n, V] logits after each decode token


@dataclass
class Comparison:
    prefill: float             # rel RMS over all prompt logits
    decode: float              # worst rel RMS over the decode steps (0 if none)
    tokens_match: bool         # ouro's greedy choice equals transformers' at every step (or ties it)

    def passes(self, tol: float = TOL) -> bool:
        return self.prefill <= tol and self.decode <= tol and self.tokens_match

    def __str__(self):
        tokens = "match" if self.tokens_match else "differ"
        return f"prefill {self.prefill:.2e}, decode {self.decode:.2e}, tokens {tokens}"


@torch.no_grad()
def reference_run(hf, ids, n_decode: int = 0, tokens: list[int] | None = None) -> Reference:
    """transformers on `ids`, then `n_decode` greedy steps (or the given `tokens` as the steps)."""
    ids = [int(t) for t in ids]
    out = hf(torch.tensor([ids]), use_cache=True)
    prefill, cache = out.logits[0].float(), out.cache
    forced, tokens, decode = tokens, [], []
    tok = int(prefill[-1].argmax())
    for step in range(n_decode if forced is None else len(forced)):
        tok = tok if forced is None else int(forced[step])
        tokens.append(tok)
        out = hf(torch.tensor([[tok]]), cache=cache, use_cache=True)
        cache = out.cache
        decode.append(out.logits[0, -1].float())
        tok = int(decode[-1].argmax())
    V = prefill.shape[-1]
    return Reference(ids, prefill, tokens, torch.stack(decode) if decode else torch.empty(0, V))


@torch.no_grad()
def ouro_run(model, ref: Reference):
    """ouro's prefill logits [L, V] and decode logits [n, V] on the reference's tokens."""
    runner = SimpleRunner(model, 1, len(ref.ids) + len(ref.tokens) + 1, poison=True)
    prefill = runner.step([ref.ids], logits="all").float()
    decode = [runner.step([[t]])[0].float() for t in ref.tokens]
    return prefill, torch.stack(decode) if decode else torch.empty(0, prefill.shape[-1])


TIE = 1e-5   # a greedy choice within this fraction of the largest logit of transformers' own is a tie


def same_choice(mine: torch.Tensor, theirs: torch.Tensor) -> bool:
    """ouro's argmax equals transformers', or transformers itself scores ouro's pick within TIE of
    its own (random tiny checkpoints have exact near-ties: a top-2 gap of 1.8e-7 was seen)."""
    a, b = int(mine.argmax()), int(theirs.argmax())
    return a == b or float(theirs[b] - theirs[a]) <= TIE * float(theirs.abs().max())


def compare(model, ref: Reference) -> Comparison:
    prefill, decode = ouro_run(model, ref)
    pairs = [(prefill[-1], ref.prefill[-1])] + list(zip(decode, ref.decode))
    return Comparison(rel_rms(prefill, ref.prefill),
                      max((rel_rms(a, b) for a, b in zip(decode, ref.decode)), default=0.0),
                      all(same_choice(a, b) for a, b in pairs))


def _capture(modules, store, key, pick):
    return [m.register_forward_hook(lambda mod, args, out, i=i: store.__setitem__((key, i), pick(out)))
            for i, m in modules]


@torch.no_grad()
def selections(hf, model, ids):
    """{layer: (transformers' selection, ouro's)} as lists of token sets, one per prompt token,
    for every DSA layer that runs its own indexer."""
    store = {}
    hf_layers = hf.model.language_model.layers
    hs = _capture([(i, l.self_attn.indexer) for i, l in enumerate(hf_layers)
                   if getattr(l.self_attn, "indexer", None) is not None], store, "hf", lambda o: o[0])
    hs += _capture([(i, l.self_attn.indexer) for i, l in enumerate(model.layers)
                    if not l.is_kda and l.self_attn.indexer is not None], store, "ouro", lambda o: o)
    try:
        hf(torch.tensor([list(ids)]))
        SimpleRunner(model, 1, len(ids)).step([list(ids)], logits="all")
    finally:
        for h in hs:
            h.remove()
    sets = lambda t: [frozenset(r[r >= 0].tolist()) for r in t]
    return {i: (sets(store[("hf", i)]), sets(store[("ouro", i)])) for (k, i) in store if k == "hf"}


def selection_diff(hf, model, ids) -> dict[int, list[int]]:
    """Layer -> prompt positions whose selected token sets differ between transformers and ouro."""
    return {i: [p for p, (a, b) in enumerate(zip(h, o)) if a != b] for i, (h, o) in selections(hf, model, ids).items()}
