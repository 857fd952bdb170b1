"""`ouro bench`: what each kind runs, and the options of `ouro bench serve` (the parser is the CLI's)."""

from __future__ import annotations

from ..config.flags import rate


def add_bench_prefill_options(bench) -> None:
    bench.add_argument("--cp", type=int, default=1, help="prefill: context-parallel ranks, timed against one "
                       "rank in the same run (each rank gets cores / ranks threads)")
    bench.add_argument("--cp-precision", default="fp32", choices=["fp32", "tf32", "tf32x3"],
                       help="prefill --cp: precision of the KDA state chain")
    bench.add_argument("--breakdown", action="store_true",
                       help="prefill: the engine's prefill of --num-prompts x --input-len, time by part against each "
                            "part's floor (--quantization, --config apply)")


def add_bench_serve_options(bench) -> None:
    g = bench.add_argument_group("serve", "`ouro bench serve`: load an OpenAI-compatible server")
    # (flag, dest, default) of this group: given to `bench offline` or `prefill` they did nothing, unsaid
    bench.set_defaults(serve_only=lambda: [(a.option_strings[0], a.dest, a.default) for a in g._group_actions])
    g.add_argument("--base-url", default="http://127.0.0.1:8000")
    g.add_argument("--endpoint", default="/v1/completions")
    g.add_argument("--image-size", default=None, metavar="HxW",
                   help="chat requests (/v1/chat/completions) each with new random images of this size, e.g. 224x224")
    g.add_argument("--images-per-request", type=int, default=1, help="with --image-size")
    g.add_argument("--api-key", default=None)
    g.add_argument("--request-rate", type=rate, default=float("inf"),
                   help="requests/s, Poisson (default inf: all at once)")
    g.add_argument("--seed", type=int, default=0, help="prompts and arrival times")
    g.add_argument("--vocab-range", default=None, help="LO,HI for the random prompt ids (default: from "
                   "--compare-offline's vocabulary, else 300,500)")
    g.add_argument("--compare-base-url", default=None, metavar="URL",
                   help="also run the same prompts against this second server, in alternating rounds (--repeats "
                        "each): e.g. a single server against `ouro serve --disagg 1P1D`")
    g.add_argument("--compare-offline", default=None, metavar="MODEL",
                   help="then run the same work through the offline engine (checkpoint dir or preset) on --device")
    g.add_argument("--offline-max-num-seqs", type=int, default=None, help="default: --max-concurrency")
    g.add_argument("--offline-max-memory", type=int, default=None, help="cache bytes (default: a fraction of free)")
    g.add_argument("--offline-mem-fraction-static", type=float, default=0.5)
    g.add_argument("--offline-page-size", type=int, default=64)
    g.add_argument("--offline-max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--offline-threads", type=int, default=None,
                   help="torch threads (default: OURO_NUM_THREADS, else torch's: the server engine's rule)")


def offline_fields(args) -> dict | None:
    """EngineConfig fields beyond bench_offline's own arguments: `--quantization-ignore`, then a
    config file's fields over it (a config file states a whole configuration)."""
    from ..config.engine import split_patterns
    from ..config.file import load_config_file
    fields = {}
    if getattr(args, "quantization_ignore", None):
        fields["quantization_ignore"] = split_patterns(args.quantization_ignore)
    fields.update(load_config_file(args.config) if args.config else {})
    return fields or None


def run_bench(args) -> int:
    """`ouro bench offline|prefill|serve`."""
    import json
    from ..config import EngineConfig, speculative_args
    from ..models.resolve import BENCH_MODEL, resolve_model
    EngineConfig(device=args.device, dtype=args.dtype).check_device()
    if args.kind != "serve":
        given = [flag for flag, dest, default in args.serve_only() if getattr(args, dest) != default]
        if given:
            raise ValueError(f"{', '.join(given)}: for `ouro bench serve` only; `bench {args.kind}` does not read them")
    if args.kind == "serve" and args.compare_base_url:
        from .serve_compare import compare_serve, format_compare
        r = compare_serve(args)
        print(format_compare(r))
    elif args.kind == "serve":
        from .serve import bench_serve, format_serve
        r = bench_serve(args)
        print(format_serve(r))
    if args.kind in ("offline", "prefill"):
        args.model = args.model or BENCH_MODEL
    if args.kind == "offline" and args.baseline:
        from .baseline import bench_baseline, format_baseline
        dtype = str(EngineConfig(device=args.device, dtype=args.dtype).torch_dtype()).replace("torch.", "")
        flags = ["--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
                 "--output-len", str(args.output_len), "--max-concurrency", str(args.max_concurrency),
                 "--device", args.device, "--dtype", dtype]
        extra = ["--compile", "--torch-compile-max-bs", str(args.torch_compile_max_bs)] if args.compile else []
        extra += ["--quantization", args.quantization] if args.quantization else []
        extra += ["--quantization-ignore", args.quantization_ignore] if args.quantization_ignore else []
        extra += ["--config", args.config] if args.config else []
        r = bench_baseline(args.baseline, str(resolve_model(args.model)), flags, args.repeats,
                           progress=not args.disable_tqdm, current_extra=extra)
        print(format_baseline(r))
    elif args.kind == "offline":
        from .offline import bench_offline, format_offline
        r = bench_offline(resolve_model(args.model), args.num_prompts, args.input_len, args.output_len,
                          args.max_concurrency, args.compare == "transformers", device=args.device, dtype=args.dtype,
                          compile=args.compile, compile_max_bs=args.torch_compile_max_bs,
                          quantization=args.quantization, speculative=speculative_args(args),
                          deterministic=args.enable_deterministic_inference,
                          engine_fields=offline_fields(args), progress=not args.disable_tqdm)
        print(format_offline(r))
    if args.kind == "prefill" and args.cp > 1:
        from .prefill_cp import bench_prefill_cp, format_prefill_cp
        dtype = EngineConfig(device=args.device, dtype=args.dtype).torch_dtype()
        r = bench_prefill_cp(resolve_model(args.model), args.input_len, args.cp, args.repeats, args.cp_precision, dtype,
                             progress=not args.disable_tqdm)
        print(format_prefill_cp(r))
    elif args.kind == "prefill" and args.breakdown:
        from ..measure.step_breakdown import format_breakdown
        from .prefill import bench_prefill_breakdown
        r = bench_prefill_breakdown(resolve_model(args.model), args.num_prompts, args.input_len, args.repeats,
                                    args.device, args.dtype, args.quantization, offline_fields(args))
        print(f"{args.model}, {args.device}, {r['threads']} threads, {r['dtype']}, quantization {r['quantization']}, "
              f"max_num_batched_tokens {r['max_num_batched_tokens']}; medians of {args.repeats} prefills")
        print(format_breakdown(r))
    elif args.kind == "prefill":
        from .prefill import bench_prefill, format_prefill
        r = bench_prefill(resolve_model(args.model), args.input_len, args.repeats, args.compare == "transformers",
                          progress=not args.disable_tqdm)
        print(format_prefill(r))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(r, f, indent=2)
    return 0
