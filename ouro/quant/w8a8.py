"""W8A8 int8 (`--quantization w8a8`) and FP8 (`--quantization fp8`): applied to a built model by
replacing modules, never by changing the model's files.

Weights: int8, symmetric, one scale per output channel. Activations: int8, symmetric, one scale per
token (row), computed on the fly. The int32 products are exact, so a row's output depends on that
row alone: a request's result never depends on the requests sharing its batch. torch's fbgemm
dynamic path (`quantized::linear_dynamic`) is not used: it quantises the whole activation tensor
with one scale, which breaks that rule. `fp8` is the same scheme in float8 e4m3 (scale amax / 448
per channel and per token; `ops.quant.fp8`), run by `torch._scaled_mm` or a float32 product of the
e4m3 values (`fp8_forms`); the modules are the same, the weight's dtype says which.

What is quantised: every `Linear` projection (attention, KDA, indexer keys and queries, dense MLPs,
shared experts) and the routed experts. What stays in the engine dtype (`UNQUANTISED`, module
name patterns; `ignore=` replaces the list): `lm_head`; the indexer's `weights_proj`; `kv_b_proj`,
whose weight the sparse attention absorbs as a tensor (`absorb_weights`), not a product; the MTP
block (layers past `num_hidden_layers`). The router gate, mHC, norms, the short conv, `A_log`,
`dt_bias` and the embeddings are not projections and are never touched."""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

from ..machine.gemm_pick import best_time, form_for
from ..layers.linear import Linear
from ..layers.moe import Experts
from ..native.kernels import fused_off
from ..ops.capture import reads_host
from ..ops.moe import clamped_swiglu
from ..ops.moe.experts import by_expert, combine, padded_by_expert
from ..ops.opaque import call_opaque
from ..ops.quant import E4M3, dequantize, quantize_rows, quantize_rows_fp8
from . import form_timers, fp8_forms, int8_forms
from .form_timers import experts_kind
from .int8_native import native, quantize_for_int8
from .packed import graph_pack, packed_for

METHODS = ("w8a8", "fp8")
QUANTIZERS = {"w8a8": quantize_rows, "fp8": quantize_rows_fp8}
UNQUANTISED = ("lm_head", "*.indexer.weights_proj", "*.kv_b_proj")
# kept whatever the patterns say: MLA absorbs kv_b_proj's matrix into the query and output
# (`ops.dsa.sparse_mla.absorb_weights`), so it is read as a weight, never run as a product
ALWAYS_KEPT = ("*.kv_b_proj",)


# offsets of "one weight, every row" (a projection): the kernel reads an empty tensor so, and no
# tensor is made from the row count (a compiled graph's is symbolic)
_ALL_ROWS = torch.empty(0, dtype=torch.long)


def _offsets(counts):
    offsets = torch.zeros(len(counts) + 1, dtype=torch.long)
    torch.cumsum(counts.cpu(), 0, out=offsets[1:])
    return offsets


def _form(forms, rows: int) -> str:
    return forms[0] if forms.count(forms[0]) == len(forms) else form_for(forms, rows, int8_forms.ROWS)


def w8a8_product(x, qweight, weight_scale, forms, owner=None, name: str = "weight"):
    """x [M, K] float -> float32 [M, N]: rows quantised, the exact int8 product in the form measured
    for M rows, the scales applied (ouro's kernel does the three in one call, the same arithmetic;
    `owner` keeps its packed copy of the weight). An e4m3 weight runs the FP8 product."""
    form = _form(forms, x.shape[0])
    if qweight.dtype == E4M3:
        qx, sx = quantize_rows_fp8(x)
        padded = None
        if form == "scaled_mm" and owner is not None:
            padded = packed_for(owner, qweight, name, fp8_forms.padded_weight)
        return fp8_forms.fp8_mm(qx, sx, qweight, weight_scale, form, padded)
    if form == "native":
        p = packed_for(owner, qweight, name) if owner is not None else native().pack_weight(qweight.unsqueeze(0))
        return native().w8a8_packed(x.float(), p, weight_scale, _ALL_ROWS, qweight.shape[0])
    return _int8_product(*quantize_for_int8(x), qweight, weight_scale, form)


def _int8_product(q, s, qweight, weight_scale, form: str):
    """Quantised rows (q, s) against an int8 weight in a torch form: the exact product, then the scales."""
    return dequantize(int8_forms.int8_mm(q, qweight, form), s, weight_scale)


def w8a8_grouped(x, qweights, weight_scales, counts, forms, owner=None, name: str = "weight"):
    """Routed experts' products in one go: x [R, K] float with rows grouped by expert (`counts[e]`
    rows for expert e, in order), qweights int8 [E, N, K], weight_scales [E, N] -> float32 [R, N]."""
    rows = max(1, x.shape[0] // max(1, int((counts > 0).sum())))
    if _form(forms, rows) == "native" and qweights.dtype == torch.int8:
        p = packed_for(owner, qweights, name) if owner is not None else native().pack_weight(qweights)
        return native().w8a8_packed(x.float(), p, weight_scales, _offsets(counts), qweights.shape[1])
    out = torch.full((x.shape[0], qweights.shape[1]), float("nan"))
    q = s = None
    start = 0
    for e, c in enumerate(counts.tolist()):
        if c:
            form = _form(forms, c)
            if form == "native" or qweights.dtype != torch.int8:
                out[start:start + c] = w8a8_product(x[start:start + c], qweights[e], weight_scales[e], forms, owner,
                                                    f"{name}.{e}")
            else:
                # every row quantised once for all experts (a row's quantisation depends on the row
                # alone: the values each expert's own call made), then each expert's exact product
                # and its scales: a prefill's 32 experts ran ~10 small ops each around `_int_mm`
                if q is None:
                    q, s = quantize_for_int8(x)
                rows = slice(start, start + c)
                out[rows] = _int8_product(q[rows], s[rows], qweights[e], weight_scales[e], form)
        start += c
    return out


class W8A8Linear(nn.Module):
    """Stands in for a `Linear`: int8 (or e4m3) weight [out, in] and its per-channel scales as
    buffers, the same call signature and hooks."""

    def __init__(self, qweight, weight_scale, bias=None, forms=None):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("weight_scale", weight_scale.float())
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.int8_forms = forms or default_forms(qweight)

    @classmethod
    def from_linear(cls, linear: nn.Linear, forms=None, method: str = "w8a8") -> "W8A8Linear":
        q, s = QUANTIZERS[method](linear.weight.detach())
        return cls(q, s, linear.bias, forms)

    @classmethod
    def merge(cls, modules):
        """One W8A8Linear with `modules`' rows stacked (`ouro.layers.merged`): per-channel scales
        stack with them, and per-token activation scales are the same for every part."""
        if any(m.bias is not None or m.in_features != modules[0].in_features or
               m.qweight.dtype != modules[0].qweight.dtype for m in modules):
            return None
        return cls(torch.cat([m.qweight for m in modules]), torch.cat([m.weight_scale for m in modules]),
                   None, modules[0].int8_forms)

    def forward(self, x):
        if torch.compiler.is_compiling():
            return self.graph_forward(x)
        return self.eager(x)

    def graph_forward(self, x):
        """Inside a compiled graph: ouro's int8 kernel as a direct op where the eager path would run
        it, torch's `_int_mm` and the quantisation around it traced where that is the form, otherwise
        the eager path as one opaque op."""
        rows = x.numel() // x.shape[-1]
        form = _form(self.int8_forms, rows)
        if form == "int_mm" and self.qweight.dtype == torch.int8 and x.device.type == "cpu":
            # the eager path is graph ops throughout (`quantize_int8`, `_int_mm`, the scales): traced as
            # it is. As an opaque op each projection re-entered Python with its quantisation as separate
            # ops: ~250 us a call, 14.5 of a 25 ms W8A8 batch-16 step on a Xeon whose `_int_mm` won
            return self.eager(x)
        pack = graph_pack(self, "weight")
        if pack is None or self.bias is not None or self.qweight.dtype != torch.int8 or fused_off() or \
                form != "native":
            return call_opaque(self, x)
        y = torch.ops.ouro_int8.w8a8_packed(x.reshape(rows, x.shape[-1]).float(), pack, self.weight_scale,
                                            _ALL_ROWS, self.out_features)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def eager(self, x):
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        y = w8a8_product(x.reshape(rows, x.shape[-1]), self.qweight, self.weight_scale, self.int8_forms, self)
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def eager_shape(self, x):
        return (*x.shape[:-1], self.out_features), x.dtype

    def extra_repr(self):
        kind = "fp8" if self.qweight.dtype == E4M3 else "w8a8"
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}"


class W8A8Experts(nn.Module):
    """Stands in for `Experts`: gate_up [E, 2I, D] and down [E, D, I] in int8 (or e4m3) with
    per-channel scales; each active expert runs its exact rows (no padding rows, whose
    quantisation would be wasted work)."""

    def __init__(self, experts: Experts, forms=None, method: str = "w8a8"):
        super().__init__()
        for name in ("gate_up_proj", "down_proj"):
            q, s = QUANTIZERS[method](getattr(experts, name).detach())
            self.register_buffer(f"{name}_q", q)
            self.register_buffer(f"{name}_scale", s)
        self.limit, self.top_k = experts.limit, experts.top_k
        self.int8_forms = forms or default_forms(self.gate_up_proj_q, experts_timer(self.gate_up_proj_q.shape, self.top_k),
                                                 experts_kind(self.gate_up_proj_q.shape))

    def forward(self, x, weights, experts):
        if torch.compiler.is_compiling():
            return self.graph_forward(x, weights, experts)
        return self.eager(x, weights, experts)

    def graph_forward(self, x, weights, experts):
        """Inside a compiled graph: `w8a8_experts` as a direct op where the eager path would run it
        (`kernel_runs`), otherwise the eager path as one opaque op."""
        gate_up, down = graph_pack(self, "gate_up"), graph_pack(self, "down")
        if gate_up is None or down is None or not self.kernel_runs(x, experts):
            return call_opaque(self, x, weights, experts)
        return torch.ops.ouro_int8.w8a8_experts(x, weights.float(), experts.long(), gate_up, self.gate_up_proj_scale,
                                                down, self.down_proj_scale, self.down_proj_q.shape[2], float(self.limit))

    def eager_shape(self, x, weights, experts):
        return x.shape, x.dtype

    def fused(self, x, experts) -> bool:
        """Whether the routed experts run as one native call (`int8_mm.cpp`'s `w8a8_experts`): host
        rows and `kernel_runs`."""
        return reads_host(x) and self.kernel_runs(x, experts)

    def kernel_runs(self, x, experts) -> bool:
        """float32 rows, int8 weights, ouro's kernel the form for the rows an expert gets, fused
        kernels on (not `kernels.eager_only()`, the reference) and no autograd."""
        E = self.gate_up_proj_q.shape[0]
        rows = max(1, experts.numel() // max(1, min(E, experts.numel())))
        return (x.dtype == torch.float32 and self.gate_up_proj_q.dtype == torch.int8 and not torch.is_grad_enabled()
                and not fused_off() and _form(self.int8_forms, rows) == "native" and native() is not None)

    def eager(self, x, weights, experts):
        T, k = experts.shape
        E = self.gate_up_proj_q.shape[0]
        # (int8 weight, per-channel scales) of both products, read by every path below
        parts = {"gate_up_proj": (self.gate_up_proj_q, self.gate_up_proj_scale),
                 "down_proj": (self.down_proj_q, self.down_proj_scale)}
        (gate_up_q, gate_up_scale), (down_q, down_scale) = parts["gate_up_proj"], parts["down_proj"]
        if self.fused(x, experts):     # one native call (packed copies shared with w8a8_grouped's)
            return native().w8a8_experts(x, weights.float(), experts.long(), packed_for(self, gate_up_q, "gate_up"),
                                         gate_up_scale, packed_for(self, down_q, "down"), down_scale, down_q.shape[2],
                                         float(self.limit))
        flat, order, counts, x_sorted = by_expert(x, experts, E)
        if not reads_host(x):
            # capturable (an accelerator, a graph): every expert runs T rows, zero-padded; a zero row
            # quantises to zeros on its own, so the padding changes no real row's result
            def each(name):
                q, s = parts[name]
                return lambda h: torch.stack([w8a8_product(h[e], q[e], s[e], self.int8_forms, self, f"{name}.{e}")
                                              for e in range(E)])
            y_sorted = padded_by_expert(x_sorted, flat[order], counts, T, E, each("gate_up_proj"), each("down_proj"),
                                        self.limit).to(x.dtype)
            return combine(y_sorted, order, weights, T, k, x.dtype)
        gate, up = w8a8_grouped(x_sorted, gate_up_q, gate_up_scale, counts, self.int8_forms, self,
                                "gate_up").chunk(2, dim=-1)
        h = clamped_swiglu(gate, up, self.limit)
        y_sorted = w8a8_grouped(h, down_q, down_scale, counts, self.int8_forms, self, "down").to(x.dtype)
        return combine(y_sorted, order, weights, T, k, x.dtype)


def default_forms(qweight, timer=None, kind: str = "product") -> list[str]:
    """The forms a weight of this kind runs in on its device, one per row count of int8_forms.ROWS
    (`kind="experts"`: the routed experts' own pick, `timer` a whole experts layer)."""
    if qweight.dtype == E4M3:
        return [fp8_forms.pick_form(str(qweight.device))] * len(int8_forms.ROWS)
    return int8_forms.pick_forms(str(qweight.device), timer, kind)


def _time_product(form: str, rows: int) -> float:
    """Seconds of one W8A8 product of int8_forms.SHAPE at `rows` rows in `form`, as a layer runs it."""
    return form_timers.time_layer(W8A8Linear, form, rows)


def experts_timer(gate_up_shape, top_k: int):
    """timer(form, rows) for the routed experts' pick, on a W8A8Experts layer (`form_timers.experts_timer`)."""
    return form_timers.experts_timer(W8A8Experts, gate_up_shape, top_k)


def product_rate(method: str = "w8a8", rows: int = 256, n: int = 2048, k: int = 2048) -> float:
    """Operations per second of this machine's W8A8 (or FP8) product in the form it picked, at a
    shape large enough to be compute-bound: the low-precision rate of a roofline floor."""
    g = torch.Generator().manual_seed(0)
    q, s = QUANTIZERS[method](torch.randn(n, k, generator=g))
    layer = W8A8Linear(q, s)
    x = torch.randn(rows, k, generator=g)
    return 2.0 * rows * n * k / best_time(lambda: layer(x), budget_s=0.2, max_reps=10)


def _ignored(name: str, patterns, n_layers: int) -> bool:
    parts = name.split(".")
    if len(parts) > 1 and parts[0] == "layers" and parts[1].isdigit() and int(parts[1]) >= n_layers:
        return True                                           # the MTP block
    return any(fnmatch.fnmatchcase(name, p) for p in (*patterns, *ALWAYS_KEPT))


def quantize_model(model: nn.Module, method: str = "w8a8", ignore=None, reference: bool = False) -> dict:
    """Replace the model's projections and routed experts in place; returns what was done:
    {"quantized": [names], "kept": [names of projections left in the engine dtype]}. `ignore`: name
    patterns kept (None: `UNQUANTISED`). `reference`: the naive modules of `quant.reference`
    instead (the lab's exact comparison)."""
    ignore = UNQUANTISED if ignore is None else tuple(ignore)
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)}, got {method!r}")
    n_layers = model.config.num_hidden_layers
    done, kept = [], []
    forms = {}          # kind -> the forms picked for it (projections; routed experts by shape)
    for name, module in list(model.named_modules()):
        if not isinstance(module, (Linear, Experts)):
            continue
        if _ignored(name, ignore, n_layers):
            kept.append(name)
            continue
        if reference:
            from .reference import reference_module
            new = reference_module(module, method)
        else:
            kind = "product" if isinstance(module, Linear) else experts_kind(module.gate_up_proj.shape)
            if kind not in forms:
                probe = QUANTIZERS[method](torch.zeros(1, 1, device=next(module.parameters()).device))[0]
                forms[kind] = default_forms(probe, _time_product if kind == "product" else
                                            experts_timer(module.gate_up_proj.shape, module.top_k), kind)
            new = (W8A8Linear.from_linear(module, forms[kind], method) if kind == "product"
                   else W8A8Experts(module, forms[kind], method))
        new._forward_pre_hooks.update(module._forward_pre_hooks)     # hooks stay (e.g. a row-parallel all-reduce)
        new._forward_hooks.update(module._forward_hooks)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        done.append(name)
    prepack(model)
    return {"quantized": done, "kept": kept}


def prepack(model: nn.Module) -> None:
    """The kernel-layout copies of every int8 host weight, made now rather than at the first forward
    (as vLLM processes weights after loading): the first prefill of `small` (16 x 512, W8A8) packed
    its routed experts inside its first step, ~240 of that step's ~1,000 ms. A weight changed later
    (a shard, a reload) is packed again at its next use (`packed_for`'s key)."""
    if native() is None:
        return
    for module in model.modules():
        if isinstance(module, W8A8Linear):
            pairs = [("weight", module.qweight)]
        elif isinstance(module, W8A8Experts):
            pairs = [("gate_up", module.gate_up_proj_q), ("down", module.down_proj_q)]
        else:
            continue
        for name, q in pairs:       # only what ouro's kernel will run (a form the machine picked)
            if q.dtype == torch.int8 and q.device.type == "cpu" and "native" in module.int8_forms:
                packed_for(module, q, name)
