"""What the W8A8 layers time to pick their int8 form (`int8_forms.pick_forms`' timers), given the layer
class to time (`w8a8` passes its own): a projection as the layer runs it, and a whole routed-experts
layer of a model's expert shape, where the fused call competes with a product per expert."""

from __future__ import annotations

import types

import torch

from ..layers.moe import Experts
from ..machine.gemm_pick import best_time
from ..ops.quant import quantize_rows
from . import int8_forms


def time_layer(linear_cls, form: str, rows: int) -> float:
    """Seconds of one W8A8 product of int8_forms.SHAPE at `rows` rows in `form`, run by `linear_cls`."""
    n, k = int8_forms.SHAPE
    g = torch.Generator().manual_seed(0)
    q, s = quantize_rows(torch.randn(n, k, generator=g))
    layer = linear_cls(q, s, forms=[form] * len(int8_forms.ROWS))
    x = torch.randn(rows, k, generator=g)
    return best_time(lambda: layer(x), budget_s=0.02, max_reps=10)


def experts_kind(gate_up_shape) -> str:
    """The experts' pick is made per expert shape (`int8_forms.pick_forms`' kind): [E, 2I, D] -> "experts 2IxD"."""
    return f"experts {gate_up_shape[-2]}x{gate_up_shape[-1]}"


def balanced_routing(rows: int, E: int, k: int) -> torch.Tensor:
    """[T, k] expert ids of T = ceil(rows * E / k) tokens: token t goes to experts t*k .. t*k + k - 1
    (mod E), so every expert gets `rows` tokens (a last partial round adds at most one) and no token
    names an expert twice (k <= E)."""
    T = max(1, -(-rows * E // k))
    return (torch.arange(T).unsqueeze(1) * k + torch.arange(k)) % E


def experts_timer(experts_cls, gate_up_shape, top_k: int):
    """timer(form, rows): seconds of an `experts_cls` layer of this shape ([E, 2I, D], up to 8 experts
    and ~2,048 tokens, `top_k` a token) whose every expert gets `rows` tokens, in `form`.
    The layer is timed, not a product: with `native` it is one fused call (both products,
    SiLU-and-multiply, the weighted sum), in another form a product per expert and the glue between.
    On an AMD EPYC Zen 5 (VNNI), `_int_mm` beat ouro's kernel on the [1024, 1024] product at 1 and 128
    rows, and the per-expert path that chose for `small`'s experts ran 2-6x slower than the fused call
    at every token count from 1 to 2,048; on a larger expert shape `_int_mm` won at 128 rows an expert."""
    E = min(int(gate_up_shape[0]), 8)
    k = max(1, min(int(top_k), E))
    two_i, D = int(gate_up_shape[1]), int(gate_up_shape[2])

    def timer(form: str, rows: int) -> float:
        g = torch.Generator().manual_seed(0)
        n = max(k, min(E, 2048 // max(rows, 1)))      # at most ~2,048 tokens a timing
        dense = Experts(types.SimpleNamespace(n_routed_experts=n, hidden_size=D, moe_intermediate_size=two_i // 2,
                                              num_experts_per_tok=k, swiglu_limit=10.0))
        with torch.no_grad():
            for p in dense.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        layer = experts_cls(dense, [form] * len(int8_forms.ROWS))
        experts = balanced_routing(rows, n, k)
        T = experts.shape[0]
        x, weights = torch.randn(T, D, generator=g), torch.rand(T, k, generator=g)
        with torch.no_grad():
            return best_time(lambda: layer(x, weights, experts), budget_s=0.02, max_reps=10)
    return timer
