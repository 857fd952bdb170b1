"""`ouro eval ppl`: the command behind the held-out bits/byte yardstick."""

from __future__ import annotations

import json
from dataclasses import asdict

from ..config import CheckpointError, EngineConfig, split_patterns
from ..engine.llm import LLM
from ..models.resolve import resolve_model
from .corpus import default_root, load_split
from .ppl import evaluate_bits_per_byte, format_result, transformers_bits_per_byte


def run_ppl(args) -> int:
    """`ouro eval ppl`: held-out bits/byte through ouro's engine (and transformers' on the same windows)."""
    EngineConfig(device=args.device, dtype=args.dtype).check_device()
    if args.context_len < 1 or (args.max_bytes is not None and args.max_bytes < 1):
        raise ValueError(f"--context-len and --max-bytes must be >= 1, got {args.context_len} and {args.max_bytes}")
    root = args.corpus if args.corpus is not None else default_root()
    docs = load_split("held_out", root, max_bytes=args.max_bytes)     # a bad corpus fails before any load
    directory = resolve_model(args.model, progress=not args.json)
    llm = LLM(str(directory), device=args.device, dtype=args.dtype, quantization=args.quantization,
              quantization_ignore=split_patterns(args.quantization_ignore), kv_cache_dtype=args.kv_cache_dtype,
              kv_cache_layer_dtype=args.kv_cache_layer_dtype)
    if llm.engine.tokenizer is None:
        raise CheckpointError(f"checkpoint {directory} has no tokenizer.json: bits/byte needs one")
    r = evaluate_bits_per_byte(llm, llm.engine.tokenizer, docs, args.context_len)
    out = {"model": args.model, "corpus": str(root), "split": "held_out", "context_len": args.context_len,
           "dtype": args.dtype, "device": args.device, "quantization": args.quantization, "ouro": asdict(r)}
    lines = [format_result(r, "ouro" + (f" {args.quantization}" if args.quantization else ""), args.dtype)]
    if args.compare_transformers:
        del llm
        t = transformers_bits_per_byte(directory, None, docs, args.context_len, args.dtype, args.device,
                                       progress=True)
        diff = r.bits_per_byte - t.bits_per_byte
        out.update(transformers=asdict(t), difference=diff, relative_difference=diff / t.bits_per_byte)
        lines += [format_result(t, "transformers", args.dtype),
                  f"ouro - transformers: {diff:+.3e} bits/byte (relative {diff / t.bits_per_byte:+.2e})"]
    print(json.dumps(out, indent=2) if args.json else "\n".join(lines))
    return 0
