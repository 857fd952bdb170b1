"""MoE balance for training: a sequence-level balance loss on the router (DeepSeek-V3's form,
for a sigmoid router) plus the auxiliary-loss-free bias update of `e_score_correction_bias`.

transformers' `load_balancing_loss_func` assumes a softmax router and recomputes its own top-k;
glm5_next routes by sigmoid scores plus a bias, group-limited, so the loss here uses the experts
each router actually chose (captured by a forward hook)."""

from __future__ import annotations

import torch

from .hf_model import routers


class RouterBalance:
    def __init__(self, model, bias_rate: float = 1e-3):
        self.routers = routers(model)
        self.bias_rate = bias_rate
        self.calls: list[tuple[torch.nn.Module, torch.Tensor, torch.Tensor]] = []
        self.handles = [r.register_forward_hook(self._hook) for r in self.routers]

    def _hook(self, router, args, output):
        if router.training:
            logits, _, topk = output
            self.calls.append((router, logits, topk))

    def loss(self) -> torch.Tensor:
        """sum over router calls of E * sum_i f_i * P_i, where f_i is the share of (token, slot)
        picks that chose expert i and P_i the mean normalised sigmoid score of expert i."""
        total = None
        for router, logits, topk in self.calls:
            e = router.num_experts
            scores = logits.float().sigmoid()
            p = (scores / scores.sum(-1, keepdim=True)).mean(0)
            f = torch.bincount(topk.flatten(), minlength=e).float() / topk.numel()
            term = e * (f.detach() * p).sum()
            total = term if total is None else total + term
        return total if total is not None else torch.zeros(())

    @torch.no_grad()
    def update_bias(self) -> float:
        """Nudge each router's bias towards under-loaded experts; returns the worst max/mean load."""
        worst = 0.0
        for router, _, topk in self.calls:
            load = torch.bincount(topk.flatten(), minlength=router.num_experts).float()
            mean = load.mean()
            router.e_score_correction_bias += self.bias_rate * torch.sign(mean - load)
            worst = max(worst, (load.max() / mean.clamp_min(1e-9)).item())
        self.calls.clear()
        return worst

    def clear(self):
        self.calls.clear()
