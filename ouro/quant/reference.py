"""The naive W8A8 (and FP8) model: every projection and the routed experts replaced by modules that quantise
the *original float weight* themselves, per channel, on every call, and run the exact reference
products (`w8a8_linear_naive`, `w8a8_experts_naive`). Slow; the lab's `quant=w8a8_ref`. Against it,
`quant=w8a8` must agree to float32 rounding: a fault in how the fast path quantises (a scale per
tensor, a scale shared across the batch) or in its kernel shows at the module it is in."""

from __future__ import annotations

from torch import nn

from ..layers.linear import Linear
from ..layers.moe import Experts
from ..ops.quant import fp8_linear_naive, quantize_rows, quantize_rows_fp8, w8a8_experts_naive, w8a8_linear_naive

# method -> (weight quantiser, reference product)
NAIVE = {"w8a8": (quantize_rows, w8a8_linear_naive), "fp8": (quantize_rows_fp8, fp8_linear_naive)}


class ReferenceW8A8Linear(nn.Module):
    def __init__(self, linear: nn.Linear, method: str = "w8a8"):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.out_features = linear.out_features
        self.method = method

    def forward(self, x):
        quantize, product = NAIVE[self.method]
        q, s = quantize(self.weight.detach())
        y = product(x, q, s)
        return (y if self.bias is None else y + self.bias.float()).to(x.dtype)


class ReferenceW8A8Experts(nn.Module):
    def __init__(self, experts: Experts, method: str = "w8a8"):
        super().__init__()
        self.gate_up_proj, self.down_proj = experts.gate_up_proj, experts.down_proj
        self.limit = experts.limit
        self.method = method

    def forward(self, x, weights, experts):
        quantize, product = NAIVE[self.method]
        (gq, gs), (dq, ds) = quantize(self.gate_up_proj.detach()), quantize(self.down_proj.detach())
        return w8a8_experts_naive(x, weights, experts, gq, gs, dq, ds, self.limit, linear=product)


def reference_module(module, method: str = "w8a8"):
    return (ReferenceW8A8Linear(module, method) if isinstance(module, Linear)
            else ReferenceW8A8Experts(module, method))
