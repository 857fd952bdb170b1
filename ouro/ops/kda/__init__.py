"""Gated delta rule (KDA) kernels: `naive` reference, `chunk` for prefill, `recurrent` for decode,
`cp` for a prompt split across ranks (slice summaries and their chain)."""

from .chunk import kda_chunk
from .cp import PRECISIONS, chain_states, slice_summary
from .naive import kda_naive
from .recurrent import kda_recurrent_step

__all__ = ["PRECISIONS", "chain_states", "kda_chunk", "kda_naive", "kda_recurrent_step", "slice_summary"]
