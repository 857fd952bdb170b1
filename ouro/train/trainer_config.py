"""Settings of a training run (kept torch-free so `ouro --help` stays fast)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainConfig:
    preset: str = "tiny-py"
    corpus: str | None = None           # None: the running Python's standard library
    steps: int = 600
    batch_size: int = 8
    seq_len: int = 512
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mtp_weight: float = 0.3
    indexer_weight: float = 1.0
    balance_weight: float = 1e-2
    bias_rate: float = 1e-3
    dense_warmup: float = 0.1           # share of steps the main attention runs dense (DSA's warm-up)
    kda_chunk_size: int = 16
    seed: int = 0
    eval_every: int = 100
    eval_max_bytes: int = 150_000
    checkpoint_every: int = 100
    max_train_bytes: int | None = None
    time_limit_s: float | None = None   # stop early (checkpoint + export) after this much training
    export_dtype: str = "bfloat16"
    threads: int | None = None
