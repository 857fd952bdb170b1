"""Chunked gated delta rule (KDA) for prefill.

Inside a chunk of C tokens the delta-rule updates form a unit-lower-triangular system
T U = diag(beta) (V - K_decayed S0) with T = I + diag(beta) A. T does not depend on the carried
state S0, so for every chunk at once we solve W_v = T^-1 diag(beta) V and W_k = T^-1 diag(beta) K_decayed;
the loop over chunks then only does U = W_v - W_k S0, the output and the state update.

The decay from token j to i is exp(gc_i - gc_j) per key channel (gc: cumulative log-decay within
the chunk). When a chunk's total log-decay stays above -80 (always true for the bounded gate,
lower bound -5, at C = 16) it factorises into exp(gc_i) * exp(-gc_j) without leaving float32's
normal range, and A becomes a plain matmul; otherwise the exact pairwise form is used.
"""

import torch
import torch.nn.functional as F

from .. import batch_invariant

# Decays below exp(-60) ~ 1e-26 are flushed to exactly 0: left alone they turn into denormal
# floats, which x86 CPUs process ~100x slower (measured: chunk 64 went from 3.2 s to 0.05 s).
FLUSH_BELOW = -60.0
FACTORISE_ABOVE = -80.0  # exp(80) ~ 5.5e34 < float32 max; exp(-80) ~ 1.8e-35 > smallest normal


def _decay(log_decay):
    return log_decay.masked_fill(log_decay < FLUSH_BELOW, float("-inf")).exp()


def _pair_scores(a, b, gc):
    """sum_c a_ic b_jc exp(gc_ic - gc_jc) for all i, j: [..., C, C] (caller masks j > i)."""
    C = gc.shape[-2]
    lower = torch.ones(C, C, dtype=torch.bool, device=gc.device).tril()
    diff = (gc.unsqueeze(-2) - gc.unsqueeze(-3)).masked_fill(~lower[..., None], float("-inf"))
    return torch.einsum("...ic,...jc,...ijc->...ij", a, b, _decay(diff))


def unit_lower_inverse(lhs):
    """(lhs [n, C, C], unit lower triangular)^-1 by forward substitution, row by row: row i is
    e_i - lhs[i, :i] @ rows[:i]. Batch-invariant (each step a product the batch-invariant bmm
    pads), where LAPACK's batched solve rounds a matrix differently with the batch's size."""
    n, C, _ = lhs.shape
    eye = torch.eye(C, device=lhs.device, dtype=lhs.dtype).expand(n, C, C)
    rows = eye[:, :1]
    for i in range(1, C):
        rows = torch.cat([rows, eye[:, i:i + 1] - lhs[:, i:i + 1, :i] @ rows], 1)
    return rows


def kda_chunk(q, k, v, g, beta, initial_state=None, chunk_size: int = 16, mm=None):
    """Same contract as `kda_naive`: q, k [B, T, H, dk]; v [B, T, H, dv]; g [B, T, H, dk];
    beta [B, T, H]; initial_state [B, H, dk, dv] or None. Sequences shorter than T must be
    right-padded with g = 0 and beta = 0 (a no-op step), so the final state is exact.
    Returns (o [B, T, H, dv], final_state [B, H, dk, dv]) in float32, or float64 for float64
    inputs (an fp64 reference run stays fp64 here). `mm(a, b)`: the product the carried state
    goes through chunk to chunk (default a @ b; context parallelism passes a precision mode)."""
    B, T, H, dk = k.shape
    cdt = torch.promote_types(q.dtype, torch.float32)
    dv = v.shape[-1]
    C = chunk_size
    pad = (-T) % C

    def chunks(x):  # [B, T, H, ...] -> [B, H, N, C, ...]
        x = x.to(cdt).transpose(1, 2)
        x = F.pad(x, (0, 0, 0, pad)) if x.dim() == 4 else F.pad(x, (0, pad))
        return x.reshape(B, H, -1, C, *x.shape[3:])
    q, k, v, g, beta = map(chunks, (q, k, v, g, beta))
    N = q.shape[2]
    gc = g.cumsum(-2)
    # one host read picks the form: the chunks' strongest total decay (gc is non-increasing)
    floor = float(gc[..., -1, :].min()) if gc.numel() else 0.0
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    strict = lower.clone().fill_diagonal_(False)
    b = beta.unsqueeze(-1)
    if floor >= FACTORISE_ABOVE:
        # exp(gc) stays a normal float: exp(gc) and exp(-gc) serve the scores, the decayed query
        # and key and the state's decay (decays of exp(-80) or more need no flush). Not 1/exp(gc):
        # its gradient, -1/exp(gc)^2, overflows float32 (ouro train differentiates this)
        e = gc.exp()
        k_in, k_out = k * e, k * (-gc).exp()               # decayed from / undecayed to the chunk start
        q_dec = q * e                                       # query reads the decayed state
        a_kk, a_qk = k_in @ k_out.transpose(-1, -2), q_dec @ k_out.transpose(-1, -2)   # [B, H, N, C, C]
        k_egc = k_in
        s_last = e[..., -1:, :]                             # [B, H, N, 1, dk]
        # key decayed to the chunk end, from the difference: exp(last) * exp(-gc) would leave
        # rounding noise where the gradient cancels exactly (a chunk's last token)
        k_dec = (k * (gc[..., -1:, :] - gc).exp()).transpose(-1, -2)
    else:  # the pairwise form holds C*C*dk numbers per chunk: one chunk at a time
        a_kk = torch.stack([_pair_scores(k[:, :, n], k[:, :, n], gc[:, :, n]) for n in range(N)], 2)
        a_qk = torch.stack([_pair_scores(q[:, :, n], k[:, :, n], gc[:, :, n]) for n in range(N)], 2)
        egc = _decay(gc)
        k_egc, q_dec = k * egc, q * egc
        last = gc[..., -1:, :]
        k_dec = (k * _decay(last - gc)).transpose(-1, -2)
        s_last = _decay(last)
    s_dec = s_last.transpose(-1, -2)                        # [B, H, N, dk, 1]
    a_kk, a_qk = a_kk.masked_fill(~strict, 0.0), a_qk.masked_fill(~lower, 0.0)
    # T^-1 once per chunk (a solve against the identity, 16 columns), then two products: on this
    # CPU 3.2 ms against 8-10 ms for solving the [C, dv + dk] right-hand side directly. The solve
    # takes a 3-D batch: torch's CPU solve is ~1000x slower on 4-D+ batches (measured, torch 2.13)
    lhs = (torch.eye(C, device=q.device, dtype=cdt) + b * a_kk).reshape(-1, C, C)
    if batch_invariant.enabled():
        t_inv = unit_lower_inverse(lhs).view(B, H, N, C, C)
    else:
        eye = torch.eye(C, device=q.device, dtype=cdt).expand(lhs.shape[0], C, C)
        t_inv = torch.linalg.solve_triangular(lhs, eye, upper=False, unitriangular=True).view(B, H, N, C, C)
    w_v, w_k = t_inv @ (b * v), t_inv @ (b * k_egc)
    S = q.new_zeros(B, H, dk, dv) if initial_state is None else initial_state.to(cdt).clone()
    # chunks by unbind and outputs by one stack, not per-chunk indexing and slice assignment:
    # under autograd (ouro train runs this) each indexed or assigned slice costs a backward pass
    # over the whole tensor, O(N^2) in the number of chunks; unbind/stack keep it O(N)
    mm = mm or torch.matmul
    outs = []
    for w_v_n, w_k_n, q_n, a_n, s_n, k_n in zip(*(t.unbind(2) for t in (w_v, w_k, q_dec, a_qk, s_dec, k_dec))):
        u = w_v_n - mm(w_k_n, S)
        outs.append(mm(q_n, S) + a_n @ u)
        S = S * s_n + mm(k_n, u)
    out = (torch.stack(outs, 2) if outs else q.new_zeros(B, H, 0, C, dv)).reshape(B, H, N * C, dv)
    return out[:, :, :T].transpose(1, 2), S
