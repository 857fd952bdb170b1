"""Gated delta rule (KDA) kernels: `naive` reference, `chunk` for prefill, `recurrent` for decode."""

from .chunk import kda_chunk
from .naive import kda_naive
from .recurrent import kda_recurrent_step

__all__ = ["kda_chunk", "kda_naive", "kda_recurrent_step"]
