"""Bytes and FLOPs of the fused native ops (`ouro.native`), for the op recorder: an op that reads a
few slots of a state cache or the chosen experts of a stacked weight must not count the whole
tensor it indexes into (the redundancy probe would call a clean decode step 4x its floor)."""

from __future__ import annotations

import torch


def _n(t) -> float:
    return float(t.numel() * t.element_size()) if isinstance(t, torch.Tensor) else 0.0


def _moe_experts(args, out):
    x, weights, experts, gate_up, down = args[:5]
    chosen = float(torch.unique(experts).numel())
    return _n(x) + _n(weights) + _n(experts) + chosen * (_n(gate_up[0]) + _n(down[0])) + _n(out)


def _kda_decode(args, out):
    small = sum(_n(t) for t in args[:10])                     # per-token inputs and the layer's weights
    conv, rec, slots, fresh = args[10:14]
    T = slots.numel()
    return small + 2 * T * (_n(conv[0]) + _n(rec[0])) + _n(slots) + _n(fresh) + _n(out)


def _rows_selected(tokens) -> float:
    return float((tokens >= 0).sum())


def _sparse_mla_decode(args, out):
    q, latents, _kind, _group, tokens, table, seq = args[:7]
    row = latents.stride(0) * latents.element_size()          # a row as stored (quantised: values and scales)
    return _n(q) + _rows_selected(tokens) * row + _n(tokens) + seq.numel() * _n(table[0]) + _n(seq) + _n(out)


def _scored_pools(positions, select_k: int, kpool: int) -> float:
    """Pools the indexer scores: a query sees (pos + 1) // kpool complete pools, and scores them
    only when there are more than it keeps."""
    vis = torch.div(positions + 1, kpool, rounding_mode="floor")
    return float(vis[vis > select_k].sum())


def _index_select_decode(args, out):
    q, w, pooled, table, seq, positions, _ps, select_k, kpool = args[:9]
    pools = _scored_pools(positions, select_k, kpool)
    return _n(q) + _n(w) + pools * _n(pooled[0]) + seq.numel() * _n(table[0]) + _n(seq) + _n(positions) + _n(out)


def _pool_keys_write(args, out):
    """Each completed pool's kpool key and gate rows read, its key row written, the ape read once (a
    graph's rows: only those `complete` marks)."""
    pooled, keys, _kind, _group, gates, ape, table, seq, ends, complete = args[:10]
    n = float(seq.numel() if complete is None else complete.sum())
    kpool = ape.shape[0]
    key_row = keys.stride(0) * keys.element_size()
    return (n * kpool * (key_row + _n(gates[0])) + n * _n(pooled[0]) + _n(ape) + n * _n(table[0])
            + _n(seq) + _n(ends))


def _write_rows(args, out):
    dst, rows, src = args[:3]
    return _n(rows) + 2.0 * _n(src)


def _moe_expert_reads(args):
    chosen = float(torch.unique(args[2]).numel())
    return {3: chosen * _n(args[3][0]), 4: chosen * _n(args[4][0])}


# op name (as the recorder names an op: without namespace and overload) -> bytes(args, out); an op not
# named reads all of its inputs and writes its outputs
NATIVE_BYTES = {"moe_experts": _moe_experts, "kda_decode": _kda_decode, "sparse_mla_decode": _sparse_mla_decode,
                "index_select_decode": _index_select_decode, "pool_keys_write": _pool_keys_write,
                "write_rows": _write_rows}
# op name -> {position of a weight argument: bytes of it the op reads}, where that is not all of it
NATIVE_WEIGHT_READS = {"moe_experts": _moe_expert_reads}


# FLOPs of the products a fused op does, counted as `module_floor.block_floors` counts its floor (a
# multiply-add is 2): the recorder takes them as the op's matmul FLOPs, so the op is core work there
def _hc_pre_flops(args, out):
    streams, fn = args[0], args[1]
    return 2.0 * streams.shape[0] * fn.numel()


def _hc_post_pre_flops(args, out):
    block_out, streams, fn = args[0], args[1], args[4]
    T, n, D = streams.shape
    return 2.0 * T * fn.numel() + 2.0 * T * n * (n + 1) * D


NATIVE_FLOPS = {
    "route": lambda args, out: 2.0 * args[0].shape[0] * args[1].numel(),
    "gemv": lambda args, out: 2.0 * args[0].shape[0] * args[1].numel(),
    "panel_linear": lambda args, out: 2.0 * args[0].shape[0] * args[1].numel(),
    "moe_experts": lambda args, out: 2.0 * args[2].numel() * (args[3][0].numel() + args[4][0].numel()),
    "kda_decode": lambda args, out: args[12].numel() * (6.0 * args[11][0].numel() + 2.0 * args[4].numel()),
    "sparse_mla_decode": lambda args, out: 4.0 * args[0].shape[1] * args[0].shape[2] * _rows_selected(args[4]),
    "index_select_decode": lambda args, out: 2.0 * args[0].shape[1] * args[0].shape[2] * _scored_pools(args[5], args[7], args[8]),
    "hc_pre": _hc_pre_flops,
    "hc_post_pre": _hc_post_pre_flops,
}
