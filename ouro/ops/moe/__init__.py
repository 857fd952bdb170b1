"""MoE kernels: group-limited sigmoid routing and expert-batched clamped-SwiGLU experts."""

from .experts import clamped_swiglu, experts_grouped, experts_looped, experts_naive
from .routing import route

__all__ = ["clamped_swiglu", "experts_grouped", "experts_looped", "experts_naive", "route"]
