"""The sub-computations a layer does inside one forward, tapped on both sides under one key, so
`numerics` against transformers names the forget gate, the hyper-connection mix or the attention
core itself, not the next module the two models share (a layer's `o_norm`, `o_proj`, the layer).

    key (under its owner)      ouro                                      transformers
    self_attn.forget_gate      KDAttention.forget_gate()                 module self_attn.forget_gate
    self_attn.causal_conv1d    op causal_conv1d (before the SiLU)        causal_conv1d_fn / _update, activation off
    self_attn.attention_core   ops kda_chunk / kda_recurrent_step;       input of self_attn.o_norm (KDA);
                               ops sparse_mla / sparse_mla_chunk         input of self_attn.o_proj (DSA)
    attn_hc.post, attn_hc.comb HyperConnection output [1], [2]           HyperConnection output [0], [1]
    attn_hc.mix                HyperConnection.mix() after attention     input of the layer's ffn_hc
    ffn_hc.mix                 HyperConnection.mix() after the FFN       the decoder layer's output
    mlp.clamped_swiglu         op clamped_swiglu                         input of mlp.down_proj (its act_fn,
                                                                         the clamps and the product)
    self_attn.f_a_proj, f_b_proj  the modules                            self_attn.forget_gate.f_a_proj, f_b_proj
    hc_head                    module HyperHead (the streams' mean)      module hc_head
    self_attn.kv_b_proj (DSA)  the latent through the absorbed weights   module self_attn.kv_b_proj (this
                               (absorb_weights' W_uk | W_uv, per head)   forward's rows of its cached latents)

The vision tower (`vision.py`; both towers use transformers' module names) names its steps
the same way (`VISION_POINTS`), read on both sides as the input of the module that consumes them:
`attn.attention_core` (attention within each frame, rope applied: the input of `attn.proj`) and
`clamped_swiglu` of each block's MLP and of the merger (the input of its `down_proj`). What
transformers runs as a module and ouro ran as a function is a module in ouro now
(`patch_embed.proj`, `downsample`: the 2x2 merge with its grouping of patches, `merger.act1`).
Not named: a hyper-connection's `input_norm`. ouro folds that per-row scale into the product
(`hc_weights`), so its error shows in `attn_hc.post` and `attn_hc.comb`.

ouro's methods are wrapped on their class while taps are on; transformers' are read with module
hooks and, for the conv, wrappers around its module-level functions. Layers import nothing here.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys

import torch
import torch.nn.functional as F

# ouro: methods recorded like ops (key = owner + "." + method name)
METHODS = (("ouro.layers.kda", "KDAttention", "forget_gate"), ("ouro.layers.mhc", "HyperConnection", "mix"))
# ouro: op functions that play one role under one name (a decode run's recurrent step lines up with
# a prefill run's chunked kernel, and both with the reference's attention)
OP_ROLES = {"kda_chunk": "attention_core", "kda_recurrent_step": "attention_core", "sparse_mla": "attention_core",
            "sparse_mla_chunk": "attention_core"}
# ouro: the fused native ops (`ouro.native`) are recorded where their eager counterparts are: `fused_taps`
# parts of a module's tuple output recorded under their own key: class -> ((key suffix, index), ...)
OURO_PARTS = {"HyperConnection": (("post", 1), ("comb", 2))}
HF_PARTS = {"HyperConnection": (("post", 0), ("comb", 1))}
# transformers: (owner class suffix, child module or "" for the owner, "in" | "out", index, key suffix)
HF_POINTS = (
    ("DecoderLayer", "ffn_hc", "in", 0, "attn_hc.mix"),
    ("DecoderLayer", "", "out", 0, "ffn_hc.mix"),
    ("LinearAttention", "o_norm", "in", 0, "attention_core"),
    ("TextAttention", "o_proj", "in", 0, "attention_core"),
    ("TextMLP", "down_proj", "in", 0, "clamped_swiglu"),     # the dense MLP's and the shared expert's
)
# transformers' module names that are another path in ouro: (suffix there, suffix here)
HF_RENAMES = ((".self_attn.forget_gate.f_a_proj", ".self_attn.f_a_proj"),
              (".self_attn.forget_gate.f_b_proj", ".self_attn.f_b_proj"))
# the vision tower: (owner class suffix, child whose input is the step, key suffix under the owner)
VISION_POINTS = (("VisionAttention", "proj", "attention_core"),
                 ("MLP", "down_proj", "clamped_swiglu"),
                 ("PatchMerger", "down_proj", "clamped_swiglu"))
# ouro: a module the reference calls whose weight ouro uses functionally (MLA absorbs kv_b_proj into the
# attention's products): (layer module, op it calls there, the caller's locals it needs, key suffix
# under the owner, what the module's output would be from them and the op's output). Recorded while
# tapping only: the layer computes nothing more.
DERIVED = (("ouro.layers.dsa", "absorb_weights", ("latent",), "kv_b_proj", "expanded_latent"),
           # the indexer's compressed pool keys, on their last tokens' rows (no module computes them)
           ("ouro.layers.dsa", "pool_keys", ("seqs", "ends"), "pool_keys", "pools_by_token"))
# transformers: modules that run over every cached row; the last rows are this forward's tokens'
HF_CACHED_ROWS = (".self_attn.kv_b_proj",)
HF_CONV = ("causal_conv1d_fn", "causal_conv1d_update")   # module-level functions of the reference
HF_MODULE = "transformers.models.glm5_next.modeling_glm5_next"


def wrap_methods(done) -> list:
    """Wrap each of METHODS on its class; `done(owner, method, fn, out)` sees every call. Returns
    (class, name, original) for the caller to restore."""
    patched = []
    for module, cls_name, method in METHODS:
        cls = getattr(importlib.import_module(module), cls_name)
        fn = cls.__dict__[method]

        def wrapped(self, *args, __fn=fn, __name=method, **kwargs):
            out = __fn(self, *args, **kwargs)
            done(self, __name, __fn, out)
            return out
        setattr(cls, method, functools.wraps(fn)(wrapped))
        patched.append((cls, method, fn))
    return patched


def parts(class_name: str, out, table) -> list:
    """(key suffix, tensor) of a module's tuple output that `table` names for its class (by suffix:
    transformers' class is `Glm5NextTextHyperConnection`)."""
    picks = next((v for k, v in table.items() if class_name.endswith(k)), ())
    return [(suffix, out[i]) for suffix, i in picks if isinstance(out, (tuple, list))
            and len(out) > i and isinstance(out[i], torch.Tensor)]


def hf_points(names: dict) -> list:
    """(module name to hook, "in" | "out", index, key) for transformers' modules {name: module}."""
    out = []
    for name, mod in names.items():
        cls = type(mod).__name__
        for owner_cls, child, read, index, suffix in HF_POINTS:
            if cls.endswith(owner_cls):
                target = f"{name}.{child}" if child else name
                if target in names:
                    out.append((target, read, index, f"{name}.{suffix}"))
    return out


def hf_rename(name: str) -> str:
    """ouro's name for transformers' module `name` (already without the language model's prefix)."""
    for theirs, ours in HF_RENAMES:
        if name.endswith(theirs):
            return name[:-len(theirs)] + ours
    return name


def vision_points(modules: dict) -> list:
    """(module whose input is the step, owner module, key) for a vision tower's {name: module}."""
    out = []
    for name, mod in modules.items():
        for owner_cls, child, suffix in VISION_POINTS:
            target = f"{name}.{child}" if name else child
            if type(mod).__name__.endswith(owner_cls) and target in modules:
                out.append((target, name, f"{name}.{suffix}" if name else suffix))
    return out


def expanded_latent(latent, w_uk, w_uv, ctx=None):
    """kv_b_proj's output as MLA's absorbed weights ([H, qk, r], [H, v, r]) make it: per head, the
    latent's key rows then its value rows, [T, H * (qk + v)] in the module's output layout."""
    w = torch.cat([w_uk, w_uv], 1)
    return F.linear(latent, w.reshape(-1, w.shape[-1]).to(latent.dtype))


def pools_by_token(seqs, ends, pooled, ctx):
    """The keys [n, d] of the pools this batch completes (pool i: sequence seqs[i], its last token at
    position ends[i]) as rows of the batch's tokens [T, d]: each on its last token's row, zeros on the
    others (every run puts the same pool on the same row; a pool whose last token is not among the
    batch's rows, one a context-parallel rank computes for its neighbours, is left out)."""
    match = (ctx.seq_index[None, :] == seqs[:, None]) & (ctx.positions[None, :] == ends[:, None])
    out = pooled.new_zeros(ctx.positions.shape[0], pooled.shape[-1])
    # a context-parallel rank computes every pool of the batch, some ending in other ranks' rows
    mine = match.any(1)
    out[match.float().argmax(1)[mine]] = pooled[mine]
    return out


def cached_rows(name: str, t, n: int):
    """This forward's n rows of a reference module in HF_CACHED_ROWS ([B, 1, L, C], L cached
    positions); t itself for any other module."""
    if name.endswith(HF_CACHED_ROWS) and isinstance(t, torch.Tensor) and t.dim() > 2:
        return t.reshape(-1, t.shape[-1])[-n:]
    return t


def wrap_hf_conv(owner_of, record) -> list:
    """Wrap the reference's conv functions: each call also records the conv's output before the
    activation (computed on a copy of the conv state, so the model's own call is unchanged) under
    `owner_of(frame-local modules) + ".causal_conv1d"`, channels-first [B, C, L]."""
    module = sys.modules.get(HF_MODULE)
    if module is None:
        return []
    patched = []
    for name in HF_CONV:
        fn = getattr(module, name, None)
        if fn is None:
            continue

        def wrapped(*args, __fn=fn, **kwargs):
            owner = owner_of()
            if owner is not None:
                call = inspect.signature(getattr(__fn, "forward", __fn)).bind(*args, **kwargs)   # a kernels Func module
                call.arguments["activation"] = None
                if "conv_state" in call.arguments:       # the decode update writes the state in place
                    call.arguments["conv_state"] = call.arguments["conv_state"].clone()
                record(f"{owner}.causal_conv1d", __fn(*call.args, **call.kwargs))
            return __fn(*args, **kwargs)
        setattr(module, name, wrapped)
        patched.append((module, name, fn))
    return patched
