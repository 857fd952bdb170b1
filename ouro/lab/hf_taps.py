"""Taps on transformers' Glm5Next text model, recorded under ouro's module names, so an
`impl=transformers` run lines up with ouro's runs module by module."""

from __future__ import annotations

import torch

from .taps import Recording, canonical


HF_PREFIX = "model.language_model."


class TransformersTaps:
    """Hooks on transformers' Glm5Next text model, recorded under ouro's module names. The driver
    sets `positions` (the absolute positions of the tokens of the next forward) before each call."""

    def __init__(self, hf_model, rec: Recording, ouro_names: dict):
        self.model, self.rec, self.ouro_names = hf_model, rec, ouro_names   # ouro name -> (kind, source)
        self.positions = None
        self.handles = []

    def __enter__(self):
        for name, mod in self.model.named_modules():
            ours = name[len(HF_PREFIX):] if name.startswith(HF_PREFIX) else name if name == "lm_head" else None
            if not ours or ours not in self.ouro_names:
                continue
            pick = 2 if type(mod).__name__.endswith("HyperConnection") else None   # (post, comb, collapsed)
            self.handles.append(mod.register_forward_hook(self._hook(ours, pick)))
            self.rec.kinds[ours], self.rec.sources[ours] = self.ouro_names[ours]
        self.handles.append(self.model.register_forward_hook(self._post))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles = []

    def _post(self, model, args, out):
        self.rec.forward_index += 1

    def _hook(self, name, pick):
        def hook(m, args, out):
            t = canonical(out, self.rec.n_experts, pick)
            if t is None or t.dim() == 0:
                return
            n = len(self.positions)
            if t.shape[0] == 1 and t.dim() >= 2 and t.shape[1] == n:
                t = t[0]
            elif t.shape[0] != n:
                return
            self.rec.add(name, t, torch.as_tensor(self.positions))
        return hook
