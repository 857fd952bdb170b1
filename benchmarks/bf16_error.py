"""bfloat16 error table: ouro in bf16 (SimpleRunner) and transformers in bf16, each against
transformers in float32, and against each other, on the reference checkpoints (ouro/lab/reference).
Prefill of `--prompt` tokens, then `--decode` greedy steps (float32 transformers' tokens fed to all).

    python benchmarks/bf16_error.py [--prompts 16] [--prompt 300] [--decode 16]
"""

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from transformers.utils import logging  # noqa: E402

from ouro.lab.reference.bf16 import PAIRS, bf16_errors, load_three  # noqa: E402
from ouro.lab.reference.checkpoint import make_hf_checkpoint  # noqa: E402

logging.set_verbosity_error()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=300)
    ap.add_argument("--decode", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    print(f"rel RMS of logits over {args.prompts} prompts ({args.prompt}-token prefill, {args.decode} decode steps)\n")
    print("| shape | phase | " + " | ".join(PAIRS) + " | ouro / transformers |")
    print("|---|---|" + "---|" * (len(PAIRS) + 1))
    for shape in ("tiny", "shared"):
        with tempfile.TemporaryDirectory() as d:
            make_hf_checkpoint(shape, d)
            errors = bf16_errors(*load_three(d), args.prompts, args.prompt, args.decode)
        for phase, e in errors.items():
            cells = " | ".join(f"{e[p]:.2e}" for p in PAIRS)
            print(f"| {shape} | {phase} | {cells} | {e[PAIRS[0]] / e[PAIRS[1]]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
