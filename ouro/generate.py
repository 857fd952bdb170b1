"""`ouro generate`: greedy continuation of one prompt, streamed to stdout."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from .config import CheckpointError, EngineConfig


def load_tokenizer(directory: Path):
    """The checkpoint's `tokenizers` tokenizer, or None when it ships without one."""
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(path))


def generate_cli(args) -> int:
    from .engine.simple_runner import SimpleRunner
    from .models.loader import load_model
    from .models.resolve import resolve_model
    directory = resolve_model(args.model)
    dtype = EngineConfig(device=args.device, dtype=args.dtype).torch_dtype()
    model = load_model(directory, dtype=dtype, device=args.device, progress=True)
    tok = load_tokenizer(directory)
    if args.prompt_token_ids:
        ids = [int(x) for x in args.prompt_token_ids.split(",")]
    elif tok is None:
        raise CheckpointError(f"{directory} has no tokenizer.json: pass --prompt-token-ids instead of --prompt")
    else:
        ids = tok.encode(args.prompt).ids
    eos = set(model.config.eos_token_ids)
    runner = SimpleRunner(model, 1, len(ids) + args.max_tokens)
    out, shown = [], ""
    logits = runner.step([ids])
    for _ in range(args.max_tokens):
        nxt = int(logits[0].argmax())
        if nxt in eos and not args.ignore_eos:
            break
        out.append(nxt)
        if tok is not None:  # print only the newly completed text
            text = tok.decode(out)
            if not text.endswith("\ufffd"):
                sys.stdout.write(text[len(shown):])
                shown = text
        else:
            sys.stdout.write(f"{nxt} ")
        sys.stdout.flush()
        logits = runner.step([[nxt]])
    if tok is not None:
        sys.stdout.write(tok.decode(out)[len(shown):])
    sys.stdout.write("\n")
    return 0
