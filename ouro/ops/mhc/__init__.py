"""mHC kernels: the hyper-connection weight projection and Sinkhorn normalisation."""

from .sinkhorn import hc_weights, sinkhorn, sinkhorn_naive

__all__ = ["hc_weights", "sinkhorn", "sinkhorn_naive"]
