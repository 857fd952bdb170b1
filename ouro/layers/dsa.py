"""DSA attention: NoPE MLA with q-LoRA over a paged latent cache, with a lightning indexer that
picks the tokens each query attends to. `shared` layers reuse the previous full layer's picks.

A selection is a [T, width] tensor of token positions (-1 unused), one row per new token of the
flat batch. A decode batch (one new token per sequence) is handled in one batched pass; prefill
chunks go sequence by sequence.
"""

import torch
from torch import nn

from ..native import mla
from ..ops.dsa import absorb_queries, absorb_weights, index_select, pool_keys, sparse_mla, sparse_mla_chunk
from ..ops.quant.kv_rows import GROUP
from .linear import Linear
from .merged import project
from .norm import RMSNorm


def cache_rows(ctx, seq_of_row, tokens):
    """Token positions [T, W] of the sequences `seq_of_row` [T] -> flat cache rows (-1 stays -1)."""
    ps = ctx.cache.page_size
    t = tokens.clamp(min=0)
    rows = ctx.page_table[seq_of_row[:, None], t // ps] * ps + t % ps
    return rows.masked_fill(tokens < 0, -1)


class Indexer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        D, d, Hi = config.hidden_size, config.index_head_dim, config.index_n_heads
        self.Hi, self.d, self.kpool = Hi, d, config.index_kpool
        self.cache_index = config.indexer_layers.index(layer_idx)
        self.select_k = config.index_topk // config.index_kpool
        self.width = config.index_topk + config.index_kpool - 1
        self.wq_b = Linear(config.q_lora_rank, Hi * d, bias=False)
        self.wk = Linear(D, d, bias=False)
        self.k_norm = nn.LayerNorm(d, eps=1e-6)
        self.weights_proj = Linear(D, Hi, bias=False)
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(config.index_kpool, d))
        self.index_kpool_compress_gate = nn.Parameter(torch.zeros(d, D))

    def _pool_rows(self, ctx, seqs, first_tokens):
        """Rows of the pooled-key cache for pools starting at `first_tokens` [n, P] of `seqs` [n]."""
        return torch.div(cache_rows(ctx, seqs, first_tokens), self.kpool, rounding_mode="floor")

    def _write_completed_pools(self, ctx):
        """Compress every pool whose last token arrived in this batch and store its key."""
        found = ctx.completed_pools(self.kpool)
        if found is None:
            return
        seqs, ends, complete = found
        ci = self.cache_index
        pooled_rows, gate_rows = ctx.cache.index_pooled[ci].view(-1, self.d), ctx.cache.index_gates[ci].view(-1, self.d)
        key_storage = mla.cache_storage(ctx.cache.key_rows(ci))
        if key_storage is not None and mla.can(gate_rows, pooled_rows, self.index_kpool_compress_ape):
            # one op: each pool's tokens read in place, its key written (the eager path below: its reference)
            mla.pool_keys_write(pooled_rows, *key_storage, GROUP, gate_rows, self.index_kpool_compress_ape, ctx.page_table,
                                seqs, ends, complete, ctx.cache.page_size)
            return
        tok = (ends + 1 - self.kpool)[:, None] + torch.arange(self.kpool, device=ends.device)
        rows = cache_rows(ctx, seqs, tok)
        keys = ctx.cache.key_rows(ci)[rows].reshape(-1, self.d)
        gates = gate_rows[rows].reshape(-1, self.d)
        pooled = pool_keys(keys, gates, self.index_kpool_compress_ape)
        dest = self._pool_rows(ctx, seqs, tok[:, :1])[:, 0]
        if complete is not None:   # a graph compresses every row's pool: unfinished ones go to scratch
            dest = torch.where(complete, dest, ctx.scratch_pool_row(self.kpool))
        mla.write_rows(pooled_rows, dest, pooled)

    def _pooled(self, ctx, seqs, n_pools: int):
        """Pool keys of the first `n_pools` pools of each sequence in `seqs`: [len(seqs), n_pools, d]."""
        first = torch.arange(n_pools, device=ctx.positions.device).expand(len(seqs), -1) * self.kpool
        return ctx.cache.index_pooled[self.cache_index].view(-1, self.d)[self._pool_rows(ctx, seqs, first)]

    @torch.no_grad()
    def forward(self, x, q_resid, ctx):
        """Returns the selection [T, width] for the batch's new tokens."""
        cache, ci = ctx.cache, self.cache_index
        keys = self.k_norm(self.wk(x))
        gates = x @ self.index_kpool_compress_gate.T
        ctx.write_rows(cache.key_rows(ci), keys)
        ctx.write_rows(cache.index_gates[ci].view(-1, self.d), gates)
        self._write_completed_pools(ctx)
        q = self.wq_b(q_resid).view(-1, self.Hi, self.d)
        w = self.weights_proj(x).float() * self.Hi ** -0.5
        args = (self.select_k, self.kpool, self.d ** -0.5, self.width)
        pool_rows = cache.index_pooled[ci].view(-1, self.d)
        if mla.can(q, w, pool_rows):
            # one op for every new token, decode or prefill: each row scores the pools its position
            # sees, read in place through the page table (a prefill chunk's pools are written above)
            return mla.index_select_decode(q, w, pool_rows, ctx.page_table, ctx.seq_index, ctx.positions,
                                           cache.page_size, *args)
        if ctx.rows_as_queries:  # each new token one query: pools padded to the longest context
            n_pools = ctx.decode_pools(self.kpool)
            pooled = self._pooled(ctx, ctx.seq_index, n_pools)
            return index_select(q, w, pooled, ctx.positions, *args)
        out = []
        for b in range(len(ctx.query_lens)):
            r = ctx.rows(b)
            pooled = self._pooled(ctx, ctx.seq_index[r][:1], ctx.context_len(b) // self.kpool)[0]
            out.append(index_select(q[r], w[r], pooled, ctx.positions[r], *args))
        return torch.cat(out)


class DSAttention(nn.Module):
    MERGED = (("q_a_proj", "kv_a_proj_with_mqa"),)     # one product (`merged.project`), forms picked with the others

    def __init__(self, config, layer_idx: int):
        super().__init__()
        D, H = config.hidden_size, config.num_attention_heads
        self.H, self.qk, self.v, self.r = H, config.qk_nope_head_dim, config.v_head_dim, config.kv_lora_rank
        self.kpool, self.topk = config.index_kpool, config.index_topk
        self.cache_index = config.dsa_layers.index(layer_idx)
        self.scale = self.qk ** -0.5
        self.q_a_proj = Linear(D, config.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = Linear(config.q_lora_rank, H * self.qk, bias=False)
        self.kv_a_proj_with_mqa = Linear(D, self.r, bias=False)
        self.kv_a_layernorm = RMSNorm(self.r, config.rms_norm_eps)
        self.kv_b_proj = Linear(self.r, H * (self.qk + self.v), bias=False)
        self.o_proj = Linear(H * self.v, D, bias=False)
        self.indexer = Indexer(config, layer_idx) if config.indexer_types[layer_idx] == "full" else None

    def forward(self, x, ctx, prev_selection=None):
        """Returns (output [T, D], the selection this layer used)."""
        parts = None if ctx.rows_as_queries else ctx.split_decode
        if parts is None:
            return self._forward(x, ctx, prev_selection)
        out, selection = x.new_empty(x.shape[0], self.o_proj.out_features), None
        for sub, rows in parts:  # decode rows in one batched pass, prefill chunks per sequence
            o, sel = self._forward(x[rows], sub, None if prev_selection is None else prev_selection[rows])
            out[rows] = o
            if selection is None:
                selection = sel.new_full((x.shape[0], sel.shape[1]), -1)
            selection[rows] = sel
        return out, selection

    def _forward(self, x, ctx, prev_selection=None):
        cache, li = ctx.cache, self.cache_index
        ctx.dsa_begin(self)
        qa, kva = project(x, self.q_a_proj, self.kv_a_proj_with_mqa)
        q_resid = self.q_a_layernorm(qa)
        q = self.q_b_proj(q_resid).view(-1, self.H, self.qk)
        latent = self.kv_a_layernorm(kva)
        flat = cache.latent_rows(li)
        ctx.write_rows(flat, latent)
        if self.indexer is not None:
            selection = self.indexer(x, q_resid, ctx)
        elif prev_selection is None:
            raise ValueError("a 'shared' DSA layer needs a previous 'full' DSA layer's selection")
        else:
            selection = prev_selection
        w_uk, w_uv = absorb_weights(self.kv_b_proj.weight, self.H, self.qk, self.v)
        ctx.dsa_attend(self)
        storage = mla.cache_storage(flat)
        if storage is not None and mla.can(q, w_uk, w_uv):
            # one op for every new token, decode or prefill: each query against its selected rows,
            # read in place. A prefill chunk's rows sit in cache for its queries; measured on a 512-token
            # chunk of `small` (2 threads, AVX2) 6.8 ms against 9.4 for the masked products per block
            out = self._attend_native(q, storage, selection, w_uk, w_uv, ctx)
        elif ctx.rows_as_queries:
            out = sparse_mla(q, flat, cache_rows(ctx, ctx.seq_index, selection), w_uk, w_uv, self.scale)
        else:
            out = q.new_full((q.shape[0], self.H, self.v), float("nan"))
            for b in range(len(ctx.query_lens)):
                L, r = ctx.context_len(b), ctx.rows(b)
                # while no query has more complete pools than it may keep, it sees the whole causal prefix
                if L // self.kpool <= self.topk // self.kpool:
                    latents = flat[cache_rows(ctx, ctx.seq_index[r][:1], torch.arange(L, device=x.device)[None])[0]]
                    out[r] = sparse_mla(q[r], latents.to(q.dtype), None, w_uk, w_uv, self.scale)
                else:   # the chunk's queries against the sequence's latents, read once per block
                    latents = flat[cache_rows(ctx, ctx.seq_index[r][:1], torch.arange(L, device=x.device)[None])[0]]
                    out[r] = sparse_mla_chunk(q[r], latents, selection[r], w_uk, w_uv, self.scale)
        return self.o_proj(out.reshape(q.shape[0], -1)), selection

    def _attend_native(self, q, storage, selection, w_uk, w_uv, ctx):
        """Each new token's query against its selected tokens: one native op over the cache rows in
        place (float32, bfloat16 or quantised: `mla.cache_storage`)."""
        _, q_lat, w_uv = absorb_queries(q, w_uk, w_uv, self.scale)      # as sparse_mla absorbs it (float32)
        o_lat = mla.sparse_mla_decode(q_lat, *storage, GROUP, selection, ctx.page_table, ctx.seq_index,
                                      ctx.cache.page_size)
        return torch.einsum("nhr,hvr->nhv", o_lat, w_uv).to(q.dtype)
