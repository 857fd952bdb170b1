"""Evaluate a finished `ouro train` run from its saved state (transformers' forward, MTP and
indexer included): held-out bits/byte, trunk and MTP top-1, MTP greedy acceptance, indexer recall.
python benchmarks/train_eval.py RUN_DIR [--max-bytes N]"""

import argparse
import json
from pathlib import Path

from ouro.eval.corpus import load_split
from ouro.models.presets import PRESETS
from ouro.train.trainer import Trainer
from ouro.train.trainer_config import TrainConfig


def main():
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("--max-bytes", type=int, default=200_000)
    args = p.parse_args()
    cfg = TrainConfig(**json.loads((Path(args.run_dir) / "train" / "config.json").read_text()))
    trainer = Trainer(cfg, args.run_dir, PRESETS[cfg.preset], progress=False)
    docs = load_split("held_out", cfg.corpus, max_bytes=args.max_bytes)
    print(json.dumps({"step": trainer.step, **trainer.evaluate(docs)}, indent=2))


if __name__ == "__main__":
    main()
