"""The original GLM config keys, beside the transformers ones: what other tools (llama.cpp's
converter among them) read from a glm5_next checkpoint's `text_config`.

- `linear_attn_config`: the KDA layers' sizes and gate, `{num_heads, head_dim,
  short_conv_kernel_size, gate_lower_bound, safe_gate}`. Read as transformers reads it: each key
  it carries overrides the flat `linear_*` field, and with `safe_gate` (default true) a missing or
  null `gate_lower_bound` means -5.0; `safe_gate: false` with no bound is the unbounded gate.
- `first_k_dense_replace`: how many leading layers have a dense MLP (the rest MoE). transformers
  does not read it (its `mlp_layer_types` says which layers are dense), so a value that disagrees
  with `mlp_layer_types` is refused rather than guessed; written only when the dense layers are a
  prefix, the one schedule it can state.
- `mla_use_nope`: the DSA layers' attention has no rotary part (`qk_rope_head_dim` 0): always true
  for glm5_next, refused when false.
- `mhc`: the hyper-connections, `{hc_mult, hc_eps, hc_sinkhorn_iters}` (transformers' field names);
  refused when it disagrees with the flat fields.
"""

from __future__ import annotations

from .errors import CheckpointError


def read(text: dict, kw: dict, defaults) -> None:
    """Fill `kw` (ModelConfig keywords read from `text`) from the original keys in `text`."""
    lac = text.get("linear_attn_config")
    if lac is not None:
        for key, field in (("head_dim", "linear_head_dim"), ("num_heads", "linear_num_heads"),
                           ("short_conv_kernel_size", "linear_conv_kernel_dim")):
            if key in lac:
                kw[field] = lac[key]
        bound = lac.get("gate_lower_bound", kw.get("linear_lower_bound", defaults.linear_lower_bound))
        if lac.get("safe_gate", True) and bound is None:
            bound = -5.0
        kw["linear_lower_bound"] = bound
    if text.get("mla_use_nope") is False:
        raise CheckpointError("config: mla_use_nope is false, but glm5_next DSA layers are NoPE (no rotary part)")
    mhc = text.get("mhc")
    if isinstance(mhc, dict):
        for key, value in mhc.items():
            if key in ("hc_mult", "hc_eps", "hc_sinkhorn_iters"):
                flat = kw.get(key, getattr(defaults, key))
                if key in kw and flat != value:
                    raise CheckpointError(f"config: mhc.{key} = {value!r} disagrees with {key} = {flat!r}")
                kw[key] = value


def check(cfg, text: dict) -> None:
    """After the config is built: `first_k_dense_replace` must say what `mlp_layer_types` says."""
    k = text.get("first_k_dense_replace")
    if k is None:
        return
    n = cfg.num_hidden_layers
    want = ("dense",) * min(k, n) + ("sparse",) * max(n - k, 0)
    if tuple(cfg.mlp_layer_types) != want:
        raise CheckpointError(f"config: first_k_dense_replace = {k} disagrees with mlp_layer_types "
                              f"{list(cfg.mlp_layer_types)} (which transformers reads); make them agree")


def write(cfg) -> dict:
    """The original keys of `cfg`, consistent with its transformers keys."""
    lb = cfg.linear_lower_bound
    out = {"linear_attn_config": {"num_heads": cfg.linear_num_heads, "head_dim": cfg.linear_head_dim,
                                  "short_conv_kernel_size": cfg.linear_conv_kernel_dim,
                                  "gate_lower_bound": lb, "safe_gate": lb is not None},
           "mla_use_nope": True,
           "mhc": {"hc_mult": cfg.hc_mult, "hc_eps": cfg.hc_eps, "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters}}
    dense = list(cfg.mlp_layer_types).count("dense")
    if tuple(cfg.mlp_layer_types[:dense]) == ("dense",) * dense:
        out["first_k_dense_replace"] = dense
    return out
