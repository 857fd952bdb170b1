"""One table of numerics tolerances: per module / op kind, per precision of the pair compared.

A tolerance bounds the relative RMS error of one token position's output (the row's error norm
over the reference row's norm, the norm floored at a fraction of the typical row so near-zero
rows do not blow up). Columns are the *less* precise dtype of the two configurations compared:
`float64` (both sides fp64), `float32` (fp32 vs fp64 or vs fp32 computed another way:
chunking, batching, transformers) and `bfloat16`. Calibrated on clean ouro with the `tiny`,
`small` and trained `tiny-py` presets (see tests/lab/test_numerics.py): clean runs sit 5-50x
below these, while the planted bugs land 100x and more above.

Discrete outputs (expert choice, token selection) flip on near-ties; at bfloat16 a few flips are
normal, so `ALLOWED_FRACTION` says what share of positions may exceed the bound before the
module counts as divergent.
"""

from __future__ import annotations

# kind -> (float64, float32, bfloat16, int8). int8: W8A8 (`quant=w8a8`) against the unquantised
# model: the per-token quantisation noise a module may add and pass. On the trained tiny-py, clean
# W8A8 sits at <= 0.21 (linear, sparse attention) and logits <= 0.04 (held-out bits/byte +0.01%);
# routing and selection flip on near-ties there too (the allowed fraction covers them). float32 column: clean fp64-vs-fp32 maxima measured on
# 96-token prompts were <= 1.7e-5 (linear: the indexer's weights_proj), <= 8.2e-6 (KDA, norms,
# on `small`), <= 3e-6 elsewhere; a TF32-rounded (10-bit) accumulation lands at >= 1e-4.
TOLERANCES: dict[str, tuple[float, float, float, float]] = {
    "embedding": (1e-12, 1e-6, 1e-2, 1e-6),
    "linear": (1e-9, 1e-4, 0.1, 0.25),
    "norm": (1e-9, 5e-5, 0.1, 0.25),
    "hc": (1e-9, 5e-5, 0.1, 0.25),            # hyper-connection weights / block input
    "conv": (1e-9, 5e-5, 0.1, 0.25),          # KDA short conv (before activation)
    "kda": (1e-9, 5e-5, 0.1, 0.25),           # KDA layer output
    "kda_gate": (1e-9, 5e-5, 0.1, 0.25),      # KDA forget gate (per-channel log-decay)
    "kda_kernel": (1e-9, 5e-5, 0.1, 0.25),    # chunked / recurrent delta rule
    "attention": (1e-9, 5e-5, 0.1, 0.25),     # sparse MLA
    "dsa": (1e-9, 5e-5, 0.1, 0.25),
    "selection": (0.0, 0.0, 0.5, 0.5),       # selected token sets: share of the union picked by one side
    "router": (1e-9, 5e-5, 0.5, 0.5),        # dense [T, E] routing weights (a flipped expert: ~1)
    "experts": (1e-9, 5e-5, 0.1, 0.25),
    "mlp": (1e-9, 5e-5, 0.1, 0.25),
    "moe": (1e-9, 5e-5, 0.1, 0.25),
    "layer": (1e-9, 5e-5, 0.1, 0.25),         # a whole decoder layer's streams
    "logits": (1e-9, 5e-5, 0.1, 0.1),
    "sampler": (1e-6, 5e-5, 0.1, 0.1),       # a pick's logprob: computed in float32 whatever the model's dtype
    "other": (1e-9, 1e-4, 0.1, 0.25),
}
COLUMNS = ("float64", "float32", "bfloat16", "int8")
# share of positions that may exceed the bound (per column); discrete kinds flip on near-ties
ALLOWED_FRACTION = {"float64": 0.0, "float32": 0.0, "bfloat16": 0.25, "int8": 0.25}
ERROR_FACTOR = 10.0   # worse than 10x the tolerance (or NaN): severity `error`

# ouro module classes / op functions -> kind
CLASS_KINDS = {
    "Embedding": "embedding", "Linear": "linear", "RMSNorm": "norm", "GatedRMSNorm": "norm",
    "LayerNorm": "norm", "HyperConnection": "hc", "HyperHead": "hc", "KDAttention": "kda", "DSAttention": "dsa",
    "Indexer": "selection", "Router": "router", "Experts": "experts", "MoE": "moe", "MLP": "mlp",
    "DecoderLayer": "layer", "ShortConv": "conv",
    "W8A8Linear": "linear", "W8A8Experts": "experts", "ReferenceW8A8Linear": "linear", "ReferenceW8A8Experts": "experts",
}
OP_KINDS = {
    "kda_chunk": "kda_kernel", "kda_recurrent_step": "kda_kernel", "kda_naive": "kda_kernel",
    "causal_conv1d": "conv", "route": "router", "experts_grouped": "experts", "sparse_mla": "attention",
    "sparse_mla_chunk": "attention",
    "index_select": "selection", "pool_keys": "linear", "hc_weights": "hc", "clamped_swiglu": "mlp",
    "forget_gate": "kda_gate", "mix": "hc",     # tapped methods (`sub_taps.METHODS`)
}


def column(dtype_a: str, dtype_b: str, quant_a: str = "none", quant_b: str = "none") -> str:
    """The precision column for a pair: the less precise of the two dtypes, or `int8` where one
    side is quantised and the other is not (both quantised, the same integers: the dtype's column)."""
    if (quant_a == "none") != (quant_b == "none"):
        return "int8"
    rank = {"float64": 0, "float32": 1, "bfloat16": 2}
    return max((dtype_a, dtype_b), key=lambda d: rank[d])


def tolerance(kind: str, col: str) -> float:
    return TOLERANCES.get(kind, TOLERANCES["other"])[COLUMNS.index(col)]


def kind_of_module(name: str, class_name: str) -> str:
    if name == "lm_head":
        return "logits"
    return CLASS_KINDS.get(class_name, "other")


def kind_of_op(op: str) -> str:
    return OP_KINDS.get(op, "other")
