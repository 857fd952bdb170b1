"""Context-parallel KDA (KCP): the pieces that let ranks prefill slices of one prompt.

The recurrence is affine in the state: token t maps S to M_t S + b_t, with
M_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) [dk, dk] and b_t = beta_t k_t v_t^T [dk, dv]. So a
slice of tokens maps any incoming state S_in to P S_in + Z, where P is the product of its M_t and
Z is the state the slice reaches from zero. Both come from one run of the chunked kernel: the
columns of the state evolve independently, so the initial state [I | 0] with values [0 | v]
ends as [P | Z] (`slice_summary`). Ranks exchange (P, Z), each chains its predecessors' summaries
from the request's initial state (`chain_states`) and reruns its slice from its true state.

The chain's products run in a selectable precision (`PRECISIONS`):
- `fp32`: exact float32 products;
- `tf32`: both operands rounded to TF32 (10 mantissa bits) before the product, accumulated in
  float32. On CUDA this is the native TF32 matmul (tensor cores round the operands themselves);
  on a CPU it is emulated. Its error grows
  along the chain, and that error is what the reference stack lost accuracy to on long contexts;
- `tf32x3`: each operand split into a TF32 high part and a TF32 remainder, and the product taken
  as hi*hi + hi*lo + lo*hi. This is three TF32 products that recover about float32 accuracy.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .chunk import kda_chunk

PRECISIONS = ("fp32", "tf32", "tf32x3")


def round_tf32(x: torch.Tensor) -> torch.Tensor:
    """float32 -> the nearest TF32 value (10 explicit mantissa bits, ties to even), still float32.
    Infinities and NaNs are left as they are."""
    if x.dtype != torch.float32:
        raise TypeError(f"round_tf32 takes float32, got {x.dtype}")
    bits = x.contiguous().view(torch.int32)
    keep = (bits >> 13) & 1                                  # lowest kept bit: ties go to even
    rounded = ((bits + 0xFFF + keep) & ~0x1FFF).view(torch.float32)
    return torch.where(torch.isfinite(x), rounded, x)


@contextmanager
def native_tf32():
    """CUDA float32 matmuls on TF32 tensor cores inside the block, the global setting restored after."""
    before = torch.backends.cuda.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.fp32_precision = before


def tf32_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with both operands in TF32: natively on CUDA, emulated elsewhere."""
    if a.is_cuda:
        with native_tf32():
            return a @ b
    return round_tf32(a) @ round_tf32(b)


def matmul(a: torch.Tensor, b: torch.Tensor, precision: str = "fp32") -> torch.Tensor:
    """a @ b in the given precision (see the module docstring); float32 in and out."""
    if precision == "fp32":
        return a @ b
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "tf32":
        return tf32_product(a, b)
    a_hi, b_hi = round_tf32(a), round_tf32(b)      # the parts are TF32 values: each product is exact in TF32
    return tf32_product(a_hi, b_hi) + tf32_product(a_hi, round_tf32(b - b_hi)) + tf32_product(round_tf32(a - a_hi), b_hi)


def slice_summary(q, k, v, g, beta, chunk_size: int = 16, precision: str = "fp32"):
    """(P [B, H, dk, dk], Z [B, H, dk, dv]) of one slice: its final state is P @ S_in + Z for any
    incoming state S_in. Same inputs as `kda_chunk` (right-padded rows with g = 0, beta = 0 are
    no-ops). The slice's own state products run in `precision`."""
    B, T, H, dk = k.shape
    dv = v.shape[-1]
    cdt = torch.promote_types(q.dtype, torch.float32)
    eye = torch.eye(dk, dtype=cdt, device=k.device).expand(B, H, dk, dk)
    start = torch.cat([eye, eye.new_zeros(B, H, dk, dv)], dim=-1)
    values = torch.cat([v.new_zeros(B, T, H, dk).to(cdt), v.to(cdt)], dim=-1)
    _, final = kda_chunk(q, k, values, g, beta, start, chunk_size, mm=_mm(precision))
    return final[..., :dk], final[..., dk:]


def chain_states(summaries, initial_state, precision: str = "fp32"):
    """The state entering each slice: [initial_state, P_0 S + Z_0, P_1 (P_0 S + Z_0) + Z_1, ...]
    for summaries [(P_0, Z_0), (P_1, Z_1), ...] of consecutive slices. The last entry is the state
    after every slice (the request's state for decode)."""
    states = [initial_state]
    for P, Z in summaries:
        states.append(matmul(P, states[-1], precision) + Z)
    return states


def _mm(precision: str):
    """The `mm` `kda_chunk` carries its state through in this precision (None: plain a @ b)."""
    return None if precision == "fp32" else (lambda a, b: matmul(a, b, precision))


def start_state(k, v, initial_state):
    """The request's state before the prompt in the compute dtype: zeros when there is none."""
    cdt = torch.promote_types(k.dtype, torch.float32)
    if initial_state is None:
        return k.new_zeros(k.shape[0], k.shape[2], k.shape[3], v.shape[-1], dtype=cdt)
    return initial_state.to(cdt)


def kda_sliced(q, k, v, g, beta, initial_state=None, cuts=(), chunk_size: int = 16, precision: str = "fp32"):
    """`kda_chunk` computed the way ranks compute it, in one process: the tokens cut at `cuts`
    (positions, any alignment), a summary per slice, the chain, then each slice run from its true
    initial state. Returns (o [B, T, H, dv], final_state) like `kda_chunk`; the reference the
    distributed path is tested against, and the yardstick of each precision mode."""
    T = k.shape[1]
    bounds = [0, *sorted(set(int(c) for c in cuts if 0 < int(c) < T)), T]
    parts = [slice(a, b) for a, b in zip(bounds, bounds[1:])]
    S0 = start_state(k, v, initial_state)
    take = lambda t, s: t[:, s]
    summaries = [slice_summary(*(take(t, s) for t in (q, k, v, g, beta)), chunk_size, precision) for s in parts[:-1]]
    states = chain_states(summaries, S0, precision)
    outs, final = [], None
    for s, state in zip(parts, states):
        o, final = kda_chunk(*(take(t, s) for t in (q, k, v, g, beta)), state, chunk_size, mm=_mm(precision))
        outs.append(o)
    return torch.cat(outs, dim=1), final
