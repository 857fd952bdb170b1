"""W8A8 int8 (`--quantization w8a8`): applied to a built model by replacing modules, never by
changing the model's files.

Weights: int8, symmetric, one scale per output channel. Activations: int8, symmetric, one scale per
token (row), computed on the fly. The int32 products are exact, so a row's output depends on that
row alone: a request's result never depends on the requests sharing its batch. torch's fbgemm
dynamic path (`quantized::linear_dynamic`) is not used: it quantises the whole activation tensor
with one scale, which breaks that rule.

What is quantised: every `Linear` projection (attention, KDA, indexer keys and queries, dense MLPs,
shared experts) and the routed experts. What stays in the engine dtype (`DEFAULT_IGNORE`, module
name patterns; `ignore=` replaces the list): `lm_head`; the indexer's `weights_proj`; `kv_b_proj`,
whose weight the sparse attention absorbs as a tensor (`absorb_weights`), not a product; the MTP
block (layers past `num_hidden_layers`). The router gate, mHC, norms, the short conv, `A_log`,
`dt_bias` and the embeddings are not projections and are never touched."""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

from ..gemm_pick import form_for
from ..layers.linear import Linear
from ..layers.moe import Experts
from ..ops.capture import reads_host
from ..ops.moe import clamped_swiglu
from ..ops.moe.experts import by_expert, combine
from ..ops.opaque import call_opaque
from ..ops.quant import dequantize, quantize_rows
from . import int8_forms
from .int8_native import native

METHODS = ("w8a8",)
DEFAULT_IGNORE = ("lm_head", "*.indexer.weights_proj", "*.kv_b_proj")


def w8a8_product(x, qweight, weight_scale, forms):
    """x [M, K] float -> float32 [M, N]: rows quantised, the int8 product in the form measured for M
    rows (ouro's kernel does all three steps in one call, with the same arithmetic)."""
    form = form_for(forms, x.shape[0], int8_forms.ROWS)
    if form == "native":
        return native().w8a8_linear(x.float(), qweight, weight_scale)
    q, s = quantize_rows(x)
    return dequantize(int8_forms.int8_mm(q, qweight, form), s, weight_scale)


def w8a8_grouped(x, qweights, weight_scales, counts, forms):
    """Routed experts' products in one go: x [R, K] float with rows grouped by expert (`counts[e]`
    rows for expert e, in order), qweights int8 [E, N, K], weight_scales [E, N] -> float32 [R, N]."""
    form = form_for(forms, max(1, x.shape[0] // max(1, int((counts > 0).sum()))), int8_forms.ROWS)
    if form == "native":
        offsets = torch.zeros(len(counts) + 1, dtype=torch.long)
        torch.cumsum(counts.cpu(), 0, out=offsets[1:])
        return native().w8a8_grouped(x.float(), qweights, weight_scales, offsets)
    out = torch.full((x.shape[0], qweights.shape[1]), float("nan"))
    start = 0
    for e, c in enumerate(counts.tolist()):
        if c:
            out[start:start + c] = w8a8_product(x[start:start + c], qweights[e], weight_scales[e], forms)
        start += c
    return out


class W8A8Linear(nn.Module):
    """Stands in for a `Linear`: int8 weight [out, in] and its per-channel scales as buffers,
    the same call signature and hooks."""

    def __init__(self, qweight, weight_scale, bias=None, forms=None):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("weight_scale", weight_scale.float())
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.int8_forms = forms or int8_forms.pick_forms(str(qweight.device))

    @classmethod
    def from_linear(cls, linear: nn.Linear, forms=None) -> "W8A8Linear":
        q, s = quantize_rows(linear.weight.detach())
        return cls(q, s, linear.bias, forms)

    def forward(self, x):
        if torch.compiler.is_compiling():
            return call_opaque(self, x)      # a compiled graph runs the int8 product as one op
        return self.eager(x)

    def eager(self, x):
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        y = w8a8_product(x.reshape(rows, x.shape[-1]), self.qweight, self.weight_scale, self.int8_forms)
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def eager_shape(self, x):
        return (*x.shape[:-1], self.out_features), x.dtype

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, w8a8"


class W8A8Experts(nn.Module):
    """Stands in for `Experts`: gate_up [E, 2I, D] and down [E, D, I] in int8 with per-channel
    scales; each active expert runs its exact rows (no padding rows, whose quantisation would be
    wasted work)."""

    def __init__(self, experts: Experts, forms=None):
        super().__init__()
        for name in ("gate_up_proj", "down_proj"):
            q, s = quantize_rows(getattr(experts, name).detach())
            self.register_buffer(f"{name}_q", q)
            self.register_buffer(f"{name}_scale", s)
        self.limit, self.top_k = experts.limit, experts.top_k
        self.int8_forms = forms or int8_forms.pick_forms(str(self.gate_up_proj_q.device))

    def forward(self, x, weights, experts):
        if torch.compiler.is_compiling():
            return call_opaque(self, x, weights, experts)
        return self.eager(x, weights, experts)

    def eager_shape(self, x, weights, experts):
        return x.shape, x.dtype

    def eager(self, x, weights, experts):
        if not reads_host(x):
            raise NotImplementedError("W8A8 routed experts run on a CPU only (they read the per-expert row counts)")
        T, k = experts.shape
        _, order, counts, x_sorted = by_expert(x, experts, self.gate_up_proj_q.shape[0])
        gate, up = w8a8_grouped(x_sorted, self.gate_up_proj_q, self.gate_up_proj_scale, counts,
                                self.int8_forms).chunk(2, dim=-1)
        h = clamped_swiglu(gate, up, self.limit)
        y_sorted = w8a8_grouped(h, self.down_proj_q, self.down_proj_scale, counts, self.int8_forms).to(x.dtype)
        return combine(y_sorted, order, weights, T, k, x.dtype)


def _ignored(name: str, patterns, n_layers: int) -> bool:
    parts = name.split(".")
    if len(parts) > 1 and parts[0] == "layers" and parts[1].isdigit() and int(parts[1]) >= n_layers:
        return True                                           # the MTP block
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def quantize_model(model: nn.Module, method: str = "w8a8", ignore=DEFAULT_IGNORE) -> dict:
    """Replace the model's projections and routed experts in place; returns what was done:
    {"quantized": [names], "kept": [names of projections left in the engine dtype]}."""
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)}, got {method!r}")
    n_layers = model.config.num_hidden_layers
    done, kept = [], []
    forms = None
    for name, module in list(model.named_modules()):
        if not isinstance(module, (Linear, Experts)):
            continue
        if _ignored(name, ignore, n_layers):
            kept.append(name)
            continue
        forms = forms or int8_forms.pick_forms(str(next(module.parameters()).device))
        new = W8A8Linear.from_linear(module, forms) if isinstance(module, Linear) else W8A8Experts(module, forms)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        done.append(name)
    return {"quantized": done, "kept": kept}
