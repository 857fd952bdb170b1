"""The transformers reference harness: checkpoints transformers itself saves, every constant tensor
randomised (`checkpoint.py`, `random_init.py`), transformers' DSA indexer given ouro's tie rule
(`tie_rule.py`), ouro and transformers run on the same tokens and compared (`compare.py`,
`bf16.py`), and the config options compared beyond the reference shapes (`options.py`). Used by
the tests and by `benchmarks/exactness_matrix.py` and `benchmarks/bf16_error.py`; transformers is
a test dependency, imported only when a checkpoint is made or a model run."""
