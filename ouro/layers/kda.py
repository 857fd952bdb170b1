"""KDA (Kimi Delta Attention) linear-attention layer over a flat batch, with per-sequence state
slots in `ModelCache`: short conv window + fp32 recurrent state."""

import torch
import torch.nn.functional as F
from torch import nn

from ..native import kda as fused_kda
from ..ops import batch_invariant
from ..ops.conv1d import causal_conv1d
from ..ops.kda import kda_recurrent_step
from .norm import GatedRMSNorm
from .linear import Linear
from .merged import project, project_cat
from .precision import KeepFloat32
from .watch import watched


def l2_normalize(x, eps: float = 1e-6):
    return x / torch.sqrt(x.square().sum(-1, keepdim=True) + eps)


class ShortConv(KeepFloat32):
    """Holds one depthwise conv kernel [C, 1, K] (the checkpoint stores q, k and v kernels apart)."""
    FLOAT32 = ("weight",)

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, 1, kernel, dtype=torch.float32))


class KDAttention(KeepFloat32):
    FLOAT32 = ("A_log", "dt_bias")
    MERGED = (("q_proj", "k_proj", "v_proj"), ("f_a_proj", "g_a_proj", "b_proj"))   # one product each (`merged`)

    def __init__(self, config, layer_idx: int, chunk_size: int = 16):
        super().__init__()
        D, H, dk = config.hidden_size, config.linear_num_heads, config.linear_head_dim
        C = H * dk
        self.layer_idx, self.H, self.dk = layer_idx, H, dk
        self.state_index = config.kda_layers.index(layer_idx)
        self.chunk_size = chunk_size
        self.lower_bound = config.linear_lower_bound
        self.q_proj, self.k_proj, self.v_proj = (Linear(D, C, bias=False) for _ in range(3))
        K = config.linear_conv_kernel_dim
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (ShortConv(C, K) for _ in range(3))
        self.f_a_proj = Linear(D, dk, bias=False)
        self.f_b_proj = Linear(dk, C, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(C, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        self.b_proj = Linear(D, H, bias=False)
        self.g_a_proj = Linear(D, dk, bias=False)
        self.g_b_proj = Linear(dk, C, bias=False)
        self.o_norm = GatedRMSNorm(dk, config.rms_norm_eps)
        self.o_proj = Linear(C, D, bias=False)

    def forget_gate(self, x, fa=None):
        """Per-channel log-decay g <= 0, [T, H, dk]. `fa`: f_a_proj(x) where it was computed already
        (in one product with g_a and b)."""
        cdt = torch.promote_types(x.dtype, torch.float32)   # float64 stays float64 (reference runs)
        raw = (self.f_b_proj(self.f_a_proj(x) if fa is None else fa).to(cdt) + self.dt_bias.to(cdt)).view(-1, self.H, self.dk)
        rate = self.A_log.to(cdt).exp().view(1, self.H, 1)
        if self.lower_bound is not None:  # bounded form: lower_bound * sigmoid(.) lies in (lb, 0)
            return self.lower_bound * torch.sigmoid(rate * raw)
        return -rate * F.softplus(raw)

    def forward(self, x, ctx):
        parts = ctx.split_decode
        if parts is None:
            return self._forward(x, ctx)
        # decode rows take the recurrent step, prefill chunks the chunked form (no padding of
        # one-token rows up to the longest chunk)
        out = x.new_empty(x.shape[0], self.o_proj.out_features)
        for sub, rows in parts:
            out[rows] = self._forward(x[rows], sub)
        return out

    def _forward(self, x, ctx):
        # deterministic inference keeps the eager step: a speculative verification and its state
        # replay run the eager pieces, and there the committed state must equal the decoded one bit
        # for bit (tests/engine/test_speculative_deterministic.py)
        if not ctx.replay and not batch_invariant.enabled() and not watched(self.o_norm) and \
                (ctx.is_decode or ctx.recurrence_is_local) and fused_kda.can(x, self.o_norm.weight, self.q_conv1d.weight):
            return self._fused(x, ctx)
        T = x.shape[0]
        cache, si = ctx.cache, self.state_index
        slots = ctx.state_slots
        in_place = ctx.slot_range
        if in_place is not None:   # views: the recurrent step below updates the cache directly
            conv_state, rec_state = cache.conv[si][in_place], cache.recurrent[si][in_place]
        else:
            conv_state, rec_state = cache.conv[si][slots], cache.recurrent[si][slots]
        if ctx.any_fresh:  # a new sequence's slot may hold a finished one's state: read it as zero
            fresh = ctx.fresh.view(-1, 1, 1)
            conv_state.masked_fill_(fresh, 0.0)
            rec_state.masked_fill_(fresh[..., None], 0.0)
        weight = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]).squeeze(1)
        # speculative rows (`ctx.replay`): their states are kept as they were; what a commit needs is recorded
        held = {b: (conv_state[b].clone(), rec_state[b].clone()) for b in ctx.replay} if ctx.replay else None

        mixed = project_cat(x, self.q_proj, self.k_proj, self.v_proj)                     # [T, 3C]
        fa, ga, b = project(x, self.f_a_proj, self.g_a_proj, self.b_proj)
        pre_conv = mixed
        lengths = ctx.query_lens_tensor
        padded = ctx.pad(mixed).transpose(1, 2)
        conv_out, new_conv = causal_conv1d(padded, weight, ctx.conv_window(padded, conv_state, lengths), lengths)
        mixed = F.silu(ctx.unpad(conv_out.transpose(1, 2)))
        cdt = torch.promote_types(x.dtype, torch.float32)   # float64 stays float64 (reference runs)
        q, k, v = (t.reshape(T, self.H, self.dk).to(cdt) for t in mixed.chunk(3, dim=-1))
        q = l2_normalize(q) * self.dk ** -0.5
        k = l2_normalize(k)
        g = self.forget_gate(x, fa)
        beta = torch.sigmoid(b.to(cdt))

        if ctx.is_decode:
            o = kda_recurrent_step(q, k, v, g, beta, rec_state)
            new_rec = rec_state
        elif ctx.rows_as_queries:
            # a few new tokens per sequence (a speculative verification): the decode step position by
            # position, batched over sequences (padding steps have g = 0, beta = 0: no change)
            new_rec = rec_state.clone()
            qp, kp, vp, gp, bp = (ctx.pad(t) for t in (q, k, v, g, beta))
            o = ctx.unpad(torch.stack([kda_recurrent_step(qp[:, t], kp[:, t], vp[:, t], gp[:, t], bp[:, t], new_rec)
                                       for t in range(qp.shape[1])], dim=1))
        else:  # padding steps get g = 0, beta = 0: they leave the state untouched
            o, new_rec = ctx.delta_rule(ctx.pad(q), ctx.pad(k), ctx.pad(v), ctx.pad(g), ctx.pad(beta),
                                        rec_state, self.chunk_size)
            o = ctx.unpad(o)
        if in_place is not None:
            cache.conv[si][in_place] = new_conv
            if new_rec is not rec_state:
                rec_state.copy_(new_rec)
        else:
            cache.conv[si].index_copy_(0, slots, new_conv.float())
            cache.recurrent[si].index_copy_(0, slots, new_rec.float())
        if held:
            for b, (conv0, rec0) in held.items():
                r = ctx.rows(b)
                ctx.replay[b].record(si, conv0, rec0, pre_conv[r], k[r], v[r], g[r], beta[r])
                slot = ctx.state_slots_list[b]
                cache.conv[si][slot] = conv0
                cache.recurrent[si][slot] = rec0

        gate = self.g_b_proj(ga).view(T, self.H, self.dk)
        o = self.o_norm(o.to(x.dtype), gate).reshape(T, -1)
        return self.o_proj(o)

    def _fused(self, x, ctx):
        """The new tokens through `ouro_native::kda_decode` (one per sequence) or `kda_prefill` (each
        sequence's tokens in order), `ouro/native/kda.cpp`: the eager code above is their reference.
        The products stay torch's; the conv, norms, gates, state update (in place in each sequence's
        slot) and the output norm are one call."""
        mixed = project_cat(x, self.q_proj, self.k_proj, self.v_proj)
        fa, ga, b = project(x, self.f_a_proj, self.g_a_proj, self.b_proj)
        weight = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]).squeeze(1)
        si = self.state_index
        args = (mixed, self.f_b_proj(fa), b, self.g_b_proj(ga), weight, self.dt_bias, self.A_log, self.lower_bound,
                self.o_norm.weight, self.o_norm.eps, ctx.cache.conv[si], ctx.cache.recurrent[si], ctx.state_slots,
                ctx.fresh)
        o = fused_kda.kda_decode(*args) if ctx.is_decode else fused_kda.kda_prefill(*args, ctx.cu_seqlens)
        return self.o_proj(o.reshape(o.shape[0], -1))
