"""RMSNorm and the sigmoid-gated RMSNorm used on the KDA output."""

import torch
from torch import nn

from ..native import norms as fused_norms


def rms_normalize(x, eps: float):
    x = x.float()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        if fused_norms.can(x, self.weight):
            return fused_norms.rms_norm(x, self.weight, self.eps)
        return self.weight * rms_normalize(x, self.eps).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last dim, then times sigmoid(gate); computed in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, gate):
        if fused_norms.can(x, gate, self.weight):
            return fused_norms.gated_rms_norm(x, gate, self.weight, self.eps)
        y = self.weight.float() * rms_normalize(x, self.eps) * torch.sigmoid(gate.float())
        return y.to(x.dtype)
