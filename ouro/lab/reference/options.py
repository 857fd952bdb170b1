"""Config options beyond the two reference shapes, each compared with transformers on a checkpoint
transformers saved (the tests' `test_options_vs_transformers.py`, `benchmarks/exactness_matrix.py`)."""

OPTIONS = {
    "linear_lower_bound=null": dict(linear_lower_bound=None),   # softplus forget gate, A_log ~ log U(1, 16)
    "tie_word_embeddings": dict(tie_word_embeddings=True),
    "norm_topk_prob=false": dict(norm_topk_prob=False),
    "n_shared_experts=2": dict(n_shared_experts=2),
    "hc_mult=2": dict(hc_mult=2),
    "hc_mult=3": dict(hc_mult=3),
}
