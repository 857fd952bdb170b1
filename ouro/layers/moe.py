"""Feed-forward blocks: the dense clamped SwiGLU MLP and the routed MoE with a shared expert."""

import torch
from torch import nn

from ..machine.gemm_pick import ROWS, best_time, form_for, packed_for, product
from ..native import experts as fused_experts
from ..native import norms as fused_norms
from ..native import router as fused_router
from ..ops import batch_invariant
from ..ops.capture import reads_host
from ..ops.opaque import call_opaque
from ..ops.moe import clamped_swiglu, experts_grouped, experts_looped, route
from .linear import Linear
from .merged import project
from .precision import KeepFloat32


class MLP(nn.Module):
    """The clamped SwiGLU MLP: dense layers, shared experts, and (with biases) the vision blocks."""
    MERGED = (("gate_proj", "up_proj"),)      # run as one product (`merged.project`), its forms picked with the others

    def __init__(self, config, intermediate_size: int, bias: bool = False):
        super().__init__()
        D = config.hidden_size
        self.gate_proj = Linear(D, intermediate_size, bias=bias)
        self.up_proj = Linear(D, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, D, bias=bias)
        self.limit = config.swiglu_limit

    def forward(self, x):
        gate, up = project(x, self.gate_proj, self.up_proj)
        if gate.dim() == 2 and fused_norms.can(gate, up):   # the merged product's halves, read in place
            return self.down_proj(fused_norms.clamped_swiglu(gate, up, self.limit))
        return self.down_proj(clamped_swiglu(gate, up, self.limit))


class Router(KeepFloat32):
    FLOAT32 = ("weight", "e_score_correction_bias")

    def __init__(self, config):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts, dtype=torch.float32))
        c = config
        self.args = (c.num_experts_per_tok, c.n_group, c.topk_group, c.norm_topk_prob, c.routed_scaling_factor)

    def forward(self, x):
        if fused_router.can(x, self.weight, self.e_score_correction_bias):
            return fused_router.route(x, self.weight, self.e_score_correction_bias, *self.args)
        logits = x.float() @ self.weight.float().T
        return route(logits, self.e_score_correction_bias, *self.args)


class Experts(nn.Module):
    """All routed experts' weights stacked: gate_up_proj [E, 2I, D], down_proj [E, D, I].

    `forms` (set by the engine from `gemm_pick`, which times this layer's whole forward both ways,
    `time_form`): where the measurement picked the packed path for the rows an expert gets on
    average (T*k/E) and host reads are free (a CPU), each expert runs its exact rows through its
    own packed weights (`gemm_pick.packed_for`); otherwise `experts_grouped`. Where the native op
    runs (float32 on a CPU, `ouro.native.experts`) it takes every row count and the forms apply
    only with the fused kernels off."""
    forms = None

    def __init__(self, config):
        super().__init__()
        E, D, I = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * I, D))
        self.down_proj = nn.Parameter(torch.zeros(E, D, I))
        self.limit = config.swiglu_limit
        self.top_k = config.num_experts_per_tok

    def pick_weight(self):
        return self.gate_up_proj[0]

    def packed_weights(self):
        return [self.gate_up_proj, self.down_proj]

    @torch.no_grad()
    def time_form(self, form: str, rows: int, repeats: int = 2) -> float:
        """Seconds of this layer's forward with `form` ('packed': the per-expert packed loop;
        'linear': experts_grouped) when the experts get `rows` tokens each on average (random
        routing). The whole path is timed, not one product: in bf16 the loop's per-expert ops
        made it 1.23x slower than the padded matmul at 16-64 tokens."""
        if form == "packed" and fused_experts.can(self.gate_up_proj) and self.gate_up_proj.dtype == torch.float32:
            return float("inf")     # the native op runs every row count here: a packed copy would only take memory
        E, D = self.gate_up_proj.shape[0], self.gate_up_proj.shape[2]
        k = min(E, self.top_k)
        T = max(1, rows * E // k)
        g = torch.Generator().manual_seed(rows)
        x = torch.randn(T, D, generator=g).to(self.gate_up_proj)
        experts = torch.rand(T, E, generator=g).argsort(-1)[:, :k].to(self.gate_up_proj.device)
        weights = torch.rand(T, k, generator=g).to(x)
        saved = self.forms
        self.forms = [form] * len(ROWS)
        try:
            return best_time(lambda: self(x, weights, experts), budget_s=0.0, min_reps=repeats)
        finally:
            self.forms = saved

    def forward(self, x, weights, experts):
        if torch.compiler.is_compiling():
            if self._takes_native(x, experts):    # the native op, directly
                return self._native(x, weights, experts)
            return call_opaque(self, x, weights, experts)    # the measured path as one op
        return self.eager(x, weights, experts)

    def _tiled(self, experts) -> bool:
        # streamed for a few rows an expert, tiled past that; under deterministic inference streamed
        # at any row count (its rows never depend on their batch, and a switch of form by batch size would)
        return fused_experts.tiled_for(experts, self.gate_up_proj.shape[0]) and not batch_invariant.enabled()

    def _takes_native(self, x, experts) -> bool:
        """Whether the native op runs these rows: float32 weights at any row count; bfloat16 weights
        in the streamed form only. Past that torch's bfloat16 GEMM runs the machine's 16-bit units
        (AMX, AVX512-BF16) where the tiled form widens to float32 FMAs: the routed experts of a 16 x
        512 prefill of `small` took 733 ms that way against 1,223 native (Xeon, AMX, 2 threads)."""
        if not fused_experts.can(x, self.gate_up_proj, self.down_proj):
            return False
        return self.gate_up_proj.dtype == torch.float32 or not self._tiled(experts)

    def _native(self, x, weights, experts):
        return fused_experts.moe_experts(x, weights, experts, self.gate_up_proj, self.down_proj, self.limit,
                                         self._tiled(experts))

    def eager_shape(self, x, weights, experts):
        return x.shape, x.dtype

    def eager(self, x, weights, experts):
        E = self.gate_up_proj.shape[0]
        if self._takes_native(x, experts):
            return self._native(x, weights, experts)
        if self.forms is not None and not torch.is_grad_enabled() and reads_host(x) and not batch_invariant.enabled() and \
                form_for(self.forms, max(1, experts.numel() // E)) == "packed":
            packs = packed_for(self, self.packed_weights())
            ups, downs = packs[:E], packs[E:]
            return experts_looped(x, weights, experts, lambda h, e: product(h, None, "packed", ups[e]),
                                  lambda h, e: product(h, None, "packed", downs[e]), self.limit, E)
        return experts_grouped(x, weights, experts, self.gate_up_proj, self.down_proj, self.limit)


class MoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate = Router(config)
        self.experts = Experts(config)
        # none where n_shared_experts is 0 (a checkpoint's zero-width shared tensors hold nothing)
        self.shared_experts = MLP(config, config.moe_intermediate_size * config.n_shared_experts) \
            if config.n_shared_experts else None

    def forward(self, x):
        weights, experts = self.gate(x)
        return with_shared(self, self.experts(x, weights, experts), x)


def with_shared(moe, routed, x):
    """The routed experts' output plus the shared experts' (where the layer has them)."""
    return routed if moe.shared_experts is None else routed + moe.shared_experts(x)
