"""`ouro train` arguments and command (imports torch/transformers only when run)."""

from __future__ import annotations

import json
import sys

from .trainer_config import TrainConfig

MAX_PARAMETERS = 2_000_000_000   # a larger shape would not train in useful time (or fit) here


def add_train_parser(sub) -> None:
    d = TrainConfig()
    tr = sub.add_parser("train", help="train a built-in shape on a corpus (needs pip install -e '.[train]')")
    tr.add_argument("--preset", default=d.preset, help=f"model shape (default: {d.preset})")
    tr.add_argument("--output", "-o", required=True, help="directory for the checkpoint (and train/ state)")
    tr.add_argument("--corpus", default=None, help="directory of .py files (default: this Python's standard library)")
    tr.add_argument("--steps", type=int, default=d.steps)
    tr.add_argument("--batch-size", type=int, default=d.batch_size)
    tr.add_argument("--seq-len", type=int, default=d.seq_len)
    tr.add_argument("--lr", type=float, default=d.lr)
    tr.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    tr.add_argument("--seed", type=int, default=d.seed)
    tr.add_argument("--eval-every", type=int, default=d.eval_every)
    tr.add_argument("--eval-max-bytes", type=int, default=d.eval_max_bytes)
    tr.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    tr.add_argument("--max-train-bytes", type=int, default=None, help="use only this much of the corpus (whole files)")
    tr.add_argument("--time-limit", type=float, default=None, help="stop (checkpoint and export) after this many minutes")
    tr.add_argument("--export-dtype", default=d.export_dtype, choices=["bfloat16", "float32"])
    tr.add_argument("--threads", type=int, default=None)
    tr.add_argument("--no-progress", action="store_true")
    tr.set_defaults(func=run_train)


def run_train(args) -> int:
    from ..models.presets import CONFIG_ONLY, PRESETS, parameter_count
    trainable = [p for p in PRESETS if p not in CONFIG_ONLY]
    if args.preset not in trainable or parameter_count(PRESETS[args.preset]) > MAX_PARAMETERS:
        raise ValueError(f"--preset {args.preset!r}: choose a trainable shape ({', '.join(trainable)}); "
                         f"ouro train is for models up to {MAX_PARAMETERS / 1e9:.0f}B parameters on one machine")
    for name in ("steps", "batch_size", "seq_len", "eval_every", "checkpoint_every"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    from .hf_model import require_transformers
    require_transformers()
    from .trainer import Trainer
    cfg = TrainConfig(preset=args.preset, corpus=args.corpus, steps=args.steps, batch_size=args.batch_size,
                      seq_len=args.seq_len, lr=args.lr, warmup_steps=min(args.warmup_steps, args.steps), seed=args.seed,
                      eval_every=args.eval_every, eval_max_bytes=args.eval_max_bytes,
                      checkpoint_every=args.checkpoint_every, max_train_bytes=args.max_train_bytes,
                      time_limit_s=None if args.time_limit is None else 60 * args.time_limit,
                      export_dtype=args.export_dtype, threads=args.threads)
    trainer = Trainer(cfg, args.output, PRESETS[args.preset], progress=not args.no_progress)
    result = trainer.run()
    ev = result["eval"] or {}
    print(json.dumps({"output": args.output, **result}, indent=2))
    print(f"ouro train: {result['step']} steps in {result['elapsed'] / 60:.1f} min; held-out bits/byte "
          f"{ev.get('bits_per_byte', float('nan')):.3f}, MTP top-1 {ev.get('mtp_top1', float('nan')):.3f}, "
          f"indexer recall {ev.get('indexer_recall', float('nan')):.3f} (chance {ev.get('recall_chance', float('nan')):.3f}); "
          f"checkpoint in {args.output}", file=sys.stderr)
    return 0
