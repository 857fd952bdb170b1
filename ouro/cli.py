"""`ouro` command line: make-model, generate (serve, bench, ... arrive with later work)."""

from __future__ import annotations

import argparse
import sys


def _cmd_make_model(args) -> int:
    from .models.presets import make_model, parameter_count, PRESETS
    path = make_model(args.preset, args.directory, seed=args.seed, overwrite=args.overwrite)
    print(f"wrote {args.preset} ({parameter_count(PRESETS[args.preset]) / 1e6:.2f}M parameters) to {path}")
    return 0


def _cmd_generate(args) -> int:
    from .generate import generate_cli
    return generate_cli(args)


def _cmd_bench(args) -> int:
    import json
    from .config import EngineConfig
    from .models.resolve import resolve_model
    EngineConfig(device=args.device, dtype=args.dtype).check_device()
    if args.kind == "serve":
        from .bench.serve import bench_serve, format_serve
        r = bench_serve(args)
        print(format_serve(r))
    if args.kind in ("offline", "prefill"):
        args.model = args.model or "small"
    if args.kind == "offline":
        from .bench.offline import bench_offline, format_offline
        r = bench_offline(resolve_model(args.model), args.num_prompts, args.input_len, args.output_len,
                          args.max_concurrency, args.compare == "transformers", device=args.device, dtype=args.dtype)
        print(format_offline(r))
    if args.kind == "prefill":
        from .bench.prefill import bench_prefill, format_prefill
        r = bench_prefill(resolve_model(args.model), args.input_len, args.repeats, args.compare == "transformers")
        print(format_prefill(r))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


def _cmd_plan(args) -> int:
    import torch
    from .config import ModelConfig
    from .engine.plan_report import format_plan
    from .models.presets import PRESETS
    config = PRESETS[args.model] if args.model in PRESETS else ModelConfig.from_hf(args.model)
    try:
        contexts = [int(c) for c in args.context.split(",")]
    except ValueError:
        raise ValueError(f"--context takes comma-separated token counts, got {args.context!r}") from None
    if any(c < 1 for c in contexts):
        raise ValueError(f"--context lengths must be >= 1 token, got {args.context!r}")
    print(format_plan(args.model, config, contexts, getattr(torch, args.kv_cache_dtype)))
    return 0


def _cmd_serve(args) -> int:
    from .serve.server import serve
    return serve(args)


def add_serve_parser(sub) -> None:
    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (default: the small preset on 127.0.0.1:8000)")
    sv.add_argument("--model", default="small", help="checkpoint directory or preset name (default: small)")
    sv.add_argument("--served-model-name", default=None, help="model name in the API (default: preset or dir name)")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health")
    sv.add_argument("--device", default="cpu")
    sv.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    sv.add_argument("--max-num-seqs", type=int, default=64, help="requests in the running batch at most")
    sv.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per engine step at most")
    sv.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    sv.add_argument("--max-queued-requests", type=int, default=256,
                    help="requests waiting beyond --max-num-seqs before new ones get 429")
    sv.add_argument("--max-memory", type=int, default=None, help="cache budget in bytes (default: a fraction of free)")
    sv.add_argument("--mem-fraction-static", type=float, default=0.5,
                    help="fraction of free memory for the cache when --max-memory is not given")
    sv.add_argument("--page-size", type=int, default=64)
    sv.add_argument("--enable-prefix-caching", action="store_true")
    sv.add_argument("--prefix-checkpoint-interval", type=int, default=1, help="pages between KDA checkpoints")
    sv.add_argument("--shutdown-timeout", type=float, default=30.0,
                    help="seconds in-flight requests get to finish after SIGTERM")
    sv.add_argument("--max-request-body-bytes", type=int, default=4 << 20)
    sv.add_argument("--logits-processors", nargs="*", default=[],
                    help="'module:Class' logits processors, each built with the checkpoint directory")
    sv.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    sv.set_defaults(func=_cmd_serve)


def add_bench_serve_options(bench) -> None:
    g = bench.add_argument_group("serve", "`ouro bench serve`: load an OpenAI-compatible server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000")
    g.add_argument("--endpoint", default="/v1/completions")
    g.add_argument("--api-key", default=None)
    g.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s, Poisson (default inf: all at once)")
    g.add_argument("--seed", type=int, default=0, help="prompts and arrival times")
    g.add_argument("--vocab-range", default=None, help="LO,HI for the random prompt ids (default: from "
                   "--compare-offline's vocabulary, else 300,500)")
    g.add_argument("--disable-tqdm", action="store_true")
    g.add_argument("--compare-offline", default=None, metavar="MODEL",
                   help="then run the same work through the offline engine (checkpoint dir or preset) on --device")
    g.add_argument("--offline-max-num-seqs", type=int, default=None, help="default: --max-concurrency")
    g.add_argument("--offline-max-memory", type=int, default=None, help="cache bytes (default: a fraction of free)")
    g.add_argument("--offline-mem-fraction-static", type=float, default=0.5)
    g.add_argument("--offline-page-size", type=int, default=64)
    g.add_argument("--offline-max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--offline-threads", type=int, default=None,
                   help="torch threads (default: OURO_NUM_THREADS, else torch's: the server engine's rule)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ouro", description="Serve and study GLM-5.3-Flash-class models.")
    sub = p.add_subparsers(dest="command", required=True)

    mk = sub.add_parser("make-model", help="write a deterministic random-init checkpoint of a preset")
    mk.add_argument("preset", help="tiny | small | flash (flash: config and tokenizer only)")
    mk.add_argument("directory")
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in DIRECTORY")
    mk.set_defaults(func=_cmd_make_model)

    gen = sub.add_parser("generate", help="greedily continue a prompt, printing tokens as they come")
    gen.add_argument("model", nargs="?", default="tiny", help="checkpoint directory or preset name (default: tiny)")
    gen.add_argument("--prompt", default="The ouro engine serves")
    gen.add_argument("--prompt-token-ids", default=None, help="comma-separated token ids instead of --prompt")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"], help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--max-memory", type=int, default=None, help="cache budget in bytes (default: a fraction of free)")
    gen.add_argument("--mem-fraction-static", type=float, default=0.5,
                     help="fraction of free memory for the cache when --max-memory is not given")
    gen.set_defaults(func=_cmd_generate)

    bench = sub.add_parser("bench", help="benchmarks, measured side by side in one run")
    bench.add_argument("kind", choices=["offline", "prefill", "serve"])
    bench.add_argument("--model", default=None, help="checkpoint directory or preset name (default: small); "
                       "serve: the model name sent (default: the server's first in /v1/models)")
    bench.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=256)
    bench.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=64)
    bench.add_argument("--num-prompts", type=int, default=64)
    bench.add_argument("--max-concurrency", type=int, default=32)
    bench.add_argument("--repeats", type=int, default=3)
    bench.add_argument("--compare", nargs="?", const="transformers", choices=["transformers", "none"],
                       default="none", help="also run transformers on the same work (--compare transformers)")
    bench.add_argument("--output-json", default=None)
    bench.add_argument("--device", default="cpu", help="offline: cpu or cuda (both systems run there)")
    bench.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"], help="offline: auto (float32 on CPU, bfloat16 on CUDA)")
    add_bench_serve_options(bench)
    bench.set_defaults(func=_cmd_bench)

    add_serve_parser(sub)

    plan = sub.add_parser("plan", help="cache memory per sequence for a model at given context lengths")
    plan.add_argument("--model", default="flash", help="preset name or checkpoint directory")
    plan.add_argument("--context", default="4096,131072,1048576", help="comma-separated context lengths")
    plan.add_argument("--kv-cache-dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    plan.set_defaults(func=_cmd_plan)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from .config import CheckpointError
    try:
        return args.func(args)
    except (CheckpointError, ValueError) as e:
        print(f"ouro: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
