"""Taps on transformers' Glm5Next text model, recorded under ouro's module names, so an
`impl=transformers` run lines up with ouro's runs module by module; the sub-computations ouro
computes in a method or an op are read where the reference computes them (`sub_taps`)."""

from __future__ import annotations

import sys

import torch

from .sub_taps import HF_PARTS, cached_rows, hf_points, hf_rename, parts, wrap_hf_conv
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
        ours = {}
        for name, mod in self.model.named_modules():
            n = name[len(HF_PREFIX):] if name.startswith(HF_PREFIX) else name if name == "lm_head" else None
            if n:
                ours[hf_rename(n)] = mod
        self.owner_names = {id(m): n for n, m in ours.items()}
        # first the sub-computations, so each is recorded before the module that holds it
        for target, read, index, key in hf_points(ours):
            if key in self.ouro_names:
                self._want(key)
                if read == "in":
                    self.handles.append(ours[target].register_forward_pre_hook(
                        lambda m, a, kw, key=key, i=index: self._add(key, [*a, *kw.values()][i]), with_kwargs=True))
                else:
                    self.handles.append(ours[target].register_forward_hook(
                        lambda m, a, o, key=key, i=index: self._add(key, o[i] if isinstance(o, tuple) else o)))
        for n, mod in ours.items():
            if n not in self.ouro_names:
                continue
            pick = 2 if type(mod).__name__.endswith("HyperConnection") else None   # (post, comb, collapsed)
            self.handles.append(mod.register_forward_hook(self._hook(n, pick)))
            self._want(n)
        self.handles.append(self.model.register_forward_hook(self._post))
        self.patched = wrap_hf_conv(self._conv_owner, self._add_channels_first)
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        for module, name, fn in reversed(self.patched):
            setattr(module, name, fn)
        self.handles, self.patched = [], []

    def _want(self, key):
        self.rec.kinds[key], self.rec.sources[key] = self.ouro_names[key]

    def _conv_owner(self):
        """The linear-attention layer whose conv runs now (a frame-local `self` up the stack)."""
        f = sys._getframe(2)
        for _ in range(8):
            if f is None:
                return None
            name = self.owner_names.get(id(f.f_locals.get("self")))
            if name is not None:
                return name if f"{name}.causal_conv1d" in self.ouro_names else None
            f = f.f_back
        return None

    def _add_channels_first(self, key, t):
        """A conv output [B, C, L] (L may include the cached window): its last len(positions) columns."""
        self._want(key)
        self._add(key, t.movedim(-1, 1)[:, -len(self.positions):])

    def _post(self, model, args, out):
        self.rec.forward_index += 1

    def _hook(self, name, pick):
        def hook(m, args, out):
            for suffix, t in parts(type(m).__name__, out, HF_PARTS):
                if f"{name}.{suffix}" in self.ouro_names:
                    self._want(f"{name}.{suffix}")
                    self._add(f"{name}.{suffix}", t)
            self._add(name, cached_rows(name, canonical(out, self.rec.n_experts, pick), len(self.positions)))
        return hook

    def _add(self, name, t):
        """Record t ([1, S, ...] or [S, ...]) at the positions of this forward's tokens."""
        if t is None or t.dim() == 0:
            return
        n = len(self.positions)
        if t.shape[0] == 1 and t.dim() >= 2 and t.shape[1] == n:
            t = t[0]
        elif t.shape[0] != n:
            return
        self.rec.add(name, t, torch.as_tensor(self.positions))
