"""Chunked gated delta rule (KDA) for prefill.

Inside a chunk of C tokens the delta-rule updates form a unit-lower-triangular system
(I + diag(beta) A) U = diag(beta) (V - K_decayed S0), solved in one batched triangular solve;
between chunks the [dk, dv] state is carried. Decays are applied pairwise (exp of differences of
cumulative log-decays, never exp of a cumulative sum's negative), so nothing overflows however
long the chunk. Only the loop over chunks is in Python.
"""

import torch
import torch.nn.functional as F

# Decays below exp(-60) ~ 1e-26 are flushed to exactly 0: left alone they turn into denormal
# floats, which x86 CPUs process ~100x slower (measured: chunk 64 went from 3.2 s to 0.05 s).
FLUSH_BELOW = -60.0


def _decay(log_decay):
    return log_decay.masked_fill(log_decay < FLUSH_BELOW, float("-inf")).exp()


def kda_chunk(q, k, v, g, beta, initial_state=None, chunk_size: int = 16):
    """Same contract as `kda_naive`: q, k [B, T, H, dk]; v [B, T, H, dv]; g [B, T, H, dk];
    beta [B, T, H]; initial_state [B, H, dk, dv] or None. Sequences shorter than T must be
    right-padded with g = 0 and beta = 0 (a no-op step), so the final state is exact.
    Returns (o [B, T, H, dv] float32, final_state [B, H, dk, dv] float32)."""
    B, T, H, dk = k.shape
    dv = v.shape[-1]
    C = chunk_size
    pad = (-T) % C
    # [B, H, N, C, d]
    def chunks(x):
        x = x.float().transpose(1, 2)
        x = F.pad(x, (0, 0, 0, pad)) if x.dim() == 4 else F.pad(x, (0, pad))
        return x.reshape(B, H, -1, C, *x.shape[3:])
    q, k, v, g, beta = map(chunks, (q, k, v, g, beta))
    n_chunks = q.shape[2]
    gc = g.cumsum(-2)
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    strict = lower.clone().fill_diagonal_(False)
    eye = torch.eye(C, device=q.device)
    S = q.new_zeros(B, H, dk, dv) if initial_state is None else initial_state.float().clone()
    out = q.new_full((B, H, n_chunks, C, dv), float("nan"))  # NaN: unwritten rows show
    for n in range(n_chunks):
        qc, kc, vc, gcn, bc = q[:, :, n], k[:, :, n], v[:, :, n], gc[:, :, n], beta[:, :, n]
        # decay from token j to token i, per key channel: exp(gc_i - gc_j) for j <= i
        diff = (gcn.unsqueeze(-2) - gcn.unsqueeze(-3)).masked_fill(~lower[..., None], float("-inf"))
        decay = _decay(diff)                                              # [B, H, C, C, dk]
        a_kk = torch.einsum("bhic,bhjc,bhijc->bhij", kc, kc, decay).masked_fill(~strict, 0.0)
        a_qk = torch.einsum("bhic,bhjc,bhijc->bhij", qc, kc, decay)
        egc = _decay(gcn)
        rhs = bc.unsqueeze(-1) * (vc - (kc * egc) @ S)
        # a 3-D batch: torch's CPU solve is ~1000x slower on 4-D batches (measured, torch 2.13)
        lhs = (eye + bc.unsqueeze(-1) * a_kk).reshape(B * H, C, C)
        u = torch.linalg.solve_triangular(lhs, rhs.reshape(B * H, C, dv), upper=False, unitriangular=True)
        u = u.view(B, H, C, dv)
        out[:, :, n] = (qc * egc) @ S + a_qk @ u
        last = gcn[:, :, -1:]                                            # [B, H, 1, dk]
        S = S * _decay(last.squeeze(-2)).unsqueeze(-1) + (kc * _decay(last - gcn)).transpose(-1, -2) @ u
    out = out.reshape(B, H, n_chunks * C, dv)[:, :, :T].transpose(1, 2)
    return out, S
