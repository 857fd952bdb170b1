"""The fused native ops (`ouro.native`) as the numerics taps see them. A fused op does the work of
one or more modules, methods or ops the eager path runs; each entry here says under which keys its
output stands, so `numerics --a fused=off --b fused=on` compares it with the eager reference there
and, where it diverges, the finding names the fused op (`where.op`), not the module after it.

An emitter `(owner name, caller's locals, output, names) -> [(key, tensor or None)]`: a tensor is
recorded under the key (the eager run records the same quantity there); None marks a key whose
module records this output itself (the op's output *is* the module's output), so only the name of
the op that computed its rows is noted.
"""

from __future__ import annotations

import torch


def owner(name, caller, out, names):
    """The op's output is its caller module's output (RMSNorm -> rms_norm, Indexer -> index_select_decode)."""
    return [(name, None)]


def role(suffix):
    """The op's output is the quantity the eager path records under `owner.suffix`."""
    return lambda name, caller, out, names: [(f"{name}.{suffix}", out)]


def hc_pre(name, caller, out, names):
    """The hyper-connection's output, and the parts the module hook records (`sub_taps.OURO_PARTS`)."""
    return [(name, None), (f"{name}.post", None), (f"{name}.comb", None)]


def hc_post(name, caller, out, names):
    return [(f"{name}.mix", None)]          # `HyperConnection.mix` records it (a tapped method)


def hc_post_pre(name, caller, out, names):
    """This hyper-connection's mix and the next one's output and parts (`HyperConnection.mix_then`):
    neither the method nor the next module runs, so their rows are recorded here."""
    got = [(f"{name}.mix", out[0])]
    nxt = names.get(id(caller.get("nxt")))
    if nxt is not None:
        got += [(nxt, out[1]), (f"{nxt}.post", out[2]), (f"{nxt}.comb", out[3])]
    return got


def sparse_mla_decode(name, caller, out, names):
    """The attended latent through W_uv: the attention core `sparse_mla` gives the eager path."""
    w_uv = caller.get("w_uv")
    if not isinstance(w_uv, torch.Tensor):
        return []
    return [(f"{name}.attention_core", torch.einsum("nhr,hvr->nhv", out, w_uv))]


def pool_keys_write(name, caller, out, names):
    """The pool keys the op wrote, read back from their rows, on their last tokens' rows (as the eager
    path's `pool_keys` is recorded: `sub_taps.pools_by_token`). A graph's form (every row, a mask) is
    not probed."""
    indexer, ctx, seqs, ends = (caller.get(k) for k in ("self", "ctx", "seqs", "ends"))
    if caller.get("complete") is not None or not isinstance(seqs, torch.Tensor):
        return []
    from .sub_taps import pools_by_token
    dest = indexer._pool_rows(ctx, seqs, (ends + 1 - indexer.kpool)[:, None])[:, 0]
    return [(f"{name}.pool_keys", pools_by_token(seqs, ends, caller["pooled_rows"][dest], ctx))]


# (module, op, emitter, the eager op whose kind the recorded quantity has)
FUSED_OPS = (
    ("ouro.native.kda", "kda_decode", role("o_norm"), "kda_recurrent_step"),
    ("ouro.native.kda", "kda_prefill", role("o_norm"), "kda_recurrent_step"),
    ("ouro.native.norms", "rms_norm", owner, None),
    ("ouro.native.norms", "gated_rms_norm", owner, None),
    ("ouro.native.norms", "clamped_swiglu", role("clamped_swiglu"), "clamped_swiglu"),
    ("ouro.native.router", "route", role("route"), "route"),
    ("ouro.native.experts", "moe_experts", owner, None),
    ("ouro.native.mhc", "hc_pre", hc_pre, None),
    ("ouro.native.mhc", "hc_post", hc_post, None),
    ("ouro.native.mhc", "hc_post_pre", hc_post_pre, "mix"),
    ("ouro.native.mla", "sparse_mla_decode", sparse_mla_decode, "sparse_mla"),
    ("ouro.native.mla", "index_select_decode", owner, None),
    ("ouro.native.mla", "pool_keys_write", pool_keys_write, "pool_keys"),
)
