"""The original GLM config keys, beside the transformers ones: what other tools (llama.cpp's
converter, vLLM's glm5_next config) read from a glm5_next checkpoint's `text_config`.

- `linear_attn_config`: the KDA layers, `{num_heads, head_dim, short_conv_kernel_size,
  gate_lower_bound, safe_gate, kda_layers, full_attn_layers}` (layer lists 0-based, as in the
  GLM-5.3-Flash checkpoint; vLLM asserts both are present). Read as transformers reads it: each
  size or gate key it carries overrides the flat `linear_*` field, and with `safe_gate` (default
  true) a missing or null `gate_lower_bound` means -5.0; `safe_gate: false` with no bound is the
  unbounded (softplus) gate. transformers ignores the layer lists (its `layer_types` says which
  layers are KDA), so lists that disagree with `layer_types` are refused rather than guessed.
- `first_k_dense_replace`: how many leading layers have a dense MLP (the rest MoE); llama.cpp and
  vLLM take 0 when it is absent. transformers does not read it (its `mlp_layer_types` says which
  layers are dense), so a value that disagrees with `mlp_layer_types` is refused; written only
  when the dense layers are a prefix, the one schedule it can state.
- `mla_use_nope`: the DSA layers' attention has no rotary part (`qk_rope_head_dim` 0): always true
  for glm5_next, refused when false.
- `mhc`: true when the residual runs as manifold-constrained hyper-connections, whose sizes are the
  flat `hc_mult`, `hc_eps`, `hc_sinkhorn_iters` (the checkpoint's own form). transformers always
  builds mHC, so false (a plain residual) is refused. The dict `{hc_mult, hc_eps,
  hc_sinkhorn_iters}` an earlier ouro wrote is still read, and refused when it disagrees with the
  flat fields.
"""

from __future__ import annotations

from .errors import CheckpointError

_GATE_KEYS = (("head_dim", "linear_head_dim"), ("num_heads", "linear_num_heads"),
              ("short_conv_kernel_size", "linear_conv_kernel_dim"))
_MHC_FIELDS = ("hc_mult", "hc_eps", "hc_sinkhorn_iters")


def read(text: dict, kw: dict, defaults) -> None:
    """Fill `kw` (ModelConfig keywords read from `text`) from the original keys in `text`."""
    lac = text.get("linear_attn_config")
    if lac is not None:
        if not isinstance(lac, dict):
            raise CheckpointError(f"config: linear_attn_config must be an object, got {lac!r}")
        for key, field in _GATE_KEYS:
            if key in lac:
                kw[field] = lac[key]
        bound = lac.get("gate_lower_bound", kw.get("linear_lower_bound", defaults.linear_lower_bound))
        if lac.get("safe_gate", True) and bound is None:
            bound = -5.0
        kw["linear_lower_bound"] = bound   # ModelConfig refuses one ouro's KDA gate cannot run
    if text.get("mla_use_nope", True) is not True:
        raise CheckpointError(f"config: mla_use_nope is {text['mla_use_nope']!r}, but glm5_next DSA layers "
                              "are NoPE (no rotary part); only true is supported")
    mhc = text.get("mhc", True)
    if isinstance(mhc, dict):          # the form an earlier ouro wrote
        for key, value in mhc.items():
            if key in _MHC_FIELDS:
                flat = kw.get(key, getattr(defaults, key))
                if key in kw and flat != value:
                    raise CheckpointError(f"config: mhc.{key} = {value!r} disagrees with {key} = {flat!r}")
                kw[key] = value
    elif mhc is not True:
        raise CheckpointError(f"config: mhc is {mhc!r}; ouro (like transformers) runs glm5_next only with "
                              "manifold-constrained hyper-connections (mhc true, sized by hc_mult)")


def check(cfg, text: dict) -> None:
    """After the config is built: `first_k_dense_replace` and `linear_attn_config`'s layer lists
    must say what `mlp_layer_types` and `layer_types` (the keys transformers reads) say."""
    n = cfg.num_hidden_layers
    k = text.get("first_k_dense_replace")
    if k is not None:
        want = ("dense",) * min(k, n) + ("sparse",) * max(n - k, 0)
        if tuple(cfg.mlp_layer_types) != want:
            raise CheckpointError(f"config: first_k_dense_replace = {k} disagrees with mlp_layer_types "
                                  f"{list(cfg.mlp_layer_types)} (which transformers reads); make them agree")
    lac = text.get("linear_attn_config") or {}
    for key, have in (("kda_layers", cfg.kda_layers), ("full_attn_layers", cfg.dsa_layers)):
        if lac.get(key) is not None and sorted(lac[key]) != have:
            raise CheckpointError(f"config: linear_attn_config.{key} = {list(lac[key])} disagrees with "
                                  f"layer_types (which transformers reads: {key} {have}, 0-based); make them agree")


def write(cfg) -> dict:
    """The original keys of `cfg`, consistent with its transformers keys."""
    lb = cfg.linear_lower_bound
    out = {"linear_attn_config": {"num_heads": cfg.linear_num_heads, "head_dim": cfg.linear_head_dim,
                                  "short_conv_kernel_size": cfg.linear_conv_kernel_dim,
                                  "gate_lower_bound": lb, "safe_gate": lb is not None,
                                  "kda_layers": cfg.kda_layers, "full_attn_layers": cfg.dsa_layers},
           "mla_use_nope": True,
           "mhc": True}
    dense = list(cfg.mlp_layer_types).count("dense")
    if tuple(cfg.mlp_layer_types[:dense]) == ("dense",) * dense:
        out["first_k_dense_replace"] = dense
    return out
