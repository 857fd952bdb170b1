"""Feed-forward blocks: the dense clamped SwiGLU MLP and the routed MoE with a shared expert."""

import torch
from torch import nn

from ..ops.moe import clamped_swiglu, experts_grouped, route
from .precision import KeepFloat32


class MLP(nn.Module):
    def __init__(self, config, intermediate_size: int):
        super().__init__()
        D = config.hidden_size
        self.gate_proj = nn.Linear(D, intermediate_size, bias=False)
        self.up_proj = nn.Linear(D, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, D, bias=False)
        self.limit = config.swiglu_limit

    def forward(self, x):
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class Router(KeepFloat32):
    FLOAT32 = ("weight", "e_score_correction_bias")

    def __init__(self, config):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts, dtype=torch.float32))
        c = config
        self.args = (c.num_experts_per_tok, c.n_group, c.topk_group, c.norm_topk_prob, c.routed_scaling_factor)

    def forward(self, x):
        logits = x.float() @ self.weight.float().T
        return route(logits, self.e_score_correction_bias, *self.args)


class Experts(nn.Module):
    """All routed experts' weights stacked: gate_up_proj [E, 2I, D], down_proj [E, D, I]."""

    def __init__(self, config):
        super().__init__()
        E, D, I = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * I, D))
        self.down_proj = nn.Parameter(torch.zeros(E, D, I))
        self.limit = config.swiglu_limit

    def forward(self, x, weights, experts):
        return experts_grouped(x, weights, experts, self.gate_up_proj, self.down_proj, self.limit)


class MoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate = Router(config)
        self.experts = Experts(config)
        self.shared_experts = MLP(config, config.moe_intermediate_size * config.n_shared_experts)

    def forward(self, x):
        weights, experts = self.gate(x)
        return self.experts(x, weights, experts) + self.shared_experts(x)
