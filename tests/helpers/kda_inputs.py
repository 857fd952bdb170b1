"""Random KDA inputs (`ops/test_kda.py`, `ops/test_kda_cp.py`, `parallel/test_cp_kda.py`)."""

import torch
import torch.nn.functional as F


def make_inputs(B, T, H, dk, dv, seed=0, with_state=False):
    """Inputs shaped like the model's: L2-normed q, k (q scaled by dk**-0.5), log-decays in (-5, 0),
    beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, dk, generator=gen), dim=-1) * dk ** -0.5
    k = F.normalize(torch.randn(B, T, H, dk, generator=gen), dim=-1)
    v = torch.randn(B, T, H, dv, generator=gen)
    g = -5 * torch.sigmoid(torch.randn(B, T, H, dk, generator=gen))
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    s0 = torch.randn(B, H, dk, dv, generator=gen) if with_state else None
    return q, k, v, g, beta, s0
