"""The training table of a run: held-out bits/byte, top-1, MTP top-1 and indexer recall at each
evaluation, with wall time and tokens/s, from `DIR/train/log.jsonl` (written by `ouro train`).
python benchmarks/training_table.py DIR"""

import json
import sys
from pathlib import Path


def main(directory: str) -> None:
    log = [json.loads(x) for x in (Path(directory) / "train" / "log.jsonl").read_text().splitlines()]
    steps = [r for r in log if "loss" in r]
    cfg = json.loads((Path(directory) / "train" / "config.json").read_text())
    per_step = cfg["batch_size"] * cfg["seq_len"]
    print("| step | train minutes | tokens seen | held-out bits/byte | top-1 | MTP top-1 | indexer recall (chance) |")
    print("|---|---|---|---|---|---|---|")
    for r in log:
        if "eval" in r:
            e = r["eval"]
            print(f"| {r['step']} | {r['elapsed'] / 60:.1f} | {r['step'] * per_step:,} | {e['bits_per_byte']:.3f} | "
                  f"{e['top1']:.3f} | {e['mtp_top1']:.3f} | {e['indexer_recall']:.3f} ({e['recall_chance']:.3f}) |")
    rates = sorted(r["tokens_per_s"] for r in steps[len(steps) // 10:])
    if rates:
        print(f"\n{len(steps)} steps of {per_step:,} tokens; median training speed {rates[len(rates) // 2]:,.0f} tokens/s; "
              f"eval on {log[0]['eval']['bytes']:,} held-out bytes")


if __name__ == "__main__":
    main(sys.argv[1])
