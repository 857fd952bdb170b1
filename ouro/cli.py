"""`ouro` command line: make-model, generate, serve, bench, plan, eval, train, probe, lab."""

from __future__ import annotations

import argparse
import os
import sys

# idle OpenMP threads sleep instead of spinning: on a machine shared with other work (or with
# the server's own processes) spinning threads took the cores the busy ones needed (a tiny
# `ouro eval ppl` ran 6.9 s instead of 0.1 s). It reaches the processes ouro starts (`python -m
# ouro.cli` has imported torch, through the ouro package, before this line runs). Where ouro set it
# rather than the user, OURO_SET_OMP_WAIT_POLICY says so: `bench --baseline` runs both sides as a
# user's own `ouro bench` would run (PASSIVE made both 1.6-1.8x slower there).
# A thread still spins briefly before it sleeps (GOMP_SPINCOUNT, ~50 us here): with no spin at all
# every parallel region of a step woke a sleeping thread, and `ouro serve`'s engine process ran a
# compiled batch-1 step in 12.0 ms against 8.2 with the spin (its batch-8 inter-token latency 27.3
# against 24.2 ms); the spin costs a sleeping process ~50 us of CPU per idle gap, not the ~5 ms of
# libgomp's default spin.
SPIN_COUNT = "1000"
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.environ["OURO_SET_OMP_WAIT_POLICY"] = "1"
    if "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
        os.environ["OURO_SET_GOMP_SPINCOUNT"] = "1"

from .config.flags import (MAX_MEMORY_HELP, add_compile_flag, add_determinism_flag, add_kv_cache_flags,  # noqa: E402
                           add_media_flags, add_parallel_flags, add_quantization_flag, add_speculative_flags,
                           float_at_least, int_in, non_empty)
from .models.resolve import BENCH_MODEL, DEFAULT_MODEL  # noqa: E402  (after the OpenMP policy)


def _cmd_make_model(args) -> int:
    from .models.presets import make_model, parameter_count, PRESETS
    path = make_model(args.preset, args.directory, seed=args.seed, overwrite=args.overwrite)
    print(f"wrote {args.preset} ({parameter_count(PRESETS[args.preset]) / 1e6:.2f}M parameters) to {path}")
    return 0


def _cmd_generate(args) -> int:
    from .generate import generate_cli
    return generate_cli(args)


def _cmd_plan(args) -> int:
    import torch
    from .config import ModelConfig, tp_args
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
    from .engine.device_plan import device_plan, format_device_plan, parse_bytes
    memory = parse_bytes(args.device_memory) if args.device_memory else None
    for c in contexts:
        print(format_device_plan(args.model, device_plan(config, c, args.tp, args.cp, getattr(torch, args.kv_cache_dtype),
                                                         device_bytes=memory, prefill_chunk=args.prefill_chunk,
                                                         ep=tp_args(args)["expert_parallel"],
                                                         layer_split=args.layer_split)))
    from .engine.vision_plan import format_vision_plan, vision_config_of
    vision = vision_config_of(args.model)
    if vision is not None:
        try:
            sizes = [tuple(int(v) for v in s.lower().split("x"))[::-1] for s in args.image_size.split(",")]
        except ValueError:
            raise ValueError(f"--image-size takes WxH sizes separated by commas, got {args.image_size!r}") from None
        print(format_vision_plan(args.model, vision, sizes))
    return 0


def add_eval_parser(sub) -> None:
    ev = sub.add_parser("eval", help="quality yardsticks through ouro's own engine")
    kinds = ev.add_subparsers(dest="eval_command", required=True)
    ppl = kinds.add_parser("ppl", help="held-out bits/byte of the corpus (every token predicted once)")
    ppl.add_argument("--model", default=DEFAULT_MODEL,
                     help=f"checkpoint directory or preset name (default: {DEFAULT_MODEL})")
    ppl.add_argument("--corpus", default=None,
                     help="directory of .py files (default: this Python's standard library); its held-out split")
    ppl.add_argument("--max-bytes", type=int, default=None, help="score only the first files fitting this size")
    ppl.add_argument("--context-len", type=int, default=1024, help="tokens of context per scoring window")
    ppl.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    add_quantization_flag(ppl)
    add_kv_cache_flags(ppl)
    ppl.add_argument("--device", default="cpu")
    ppl.add_argument("--compare-transformers", action="store_true",
                     help="also score the same windows with transformers and print the difference")
    ppl.add_argument("--json", action="store_true", help="print one JSON object instead of the result lines")
    from .eval.command import run_ppl
    ppl.set_defaults(func=run_ppl)


def apply_config_file(args) -> None:
    """`--config FILE`: its engine options become this command's, except the flags given."""
    if getattr(args, "config", None):
        from .config.file import apply_to_args, load_config_file
        apply_to_args(args, args.argv, args.options_parser, load_config_file(args.config))


def _cmd_serve(args) -> int:
    from .disagg.command import run_role, serve_disagg
    from .serve.server import serve
    apply_config_file(args)
    if args.role:
        return run_role(args)
    if args.disagg:
        return serve_disagg(args)
    return serve(args)


def add_serve_parser(sub) -> None:
    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (default: the trained tiny-py model on 127.0.0.1:8000)")
    sv.add_argument("--model", default=DEFAULT_MODEL,
                    help=f"checkpoint directory or preset name (default: {DEFAULT_MODEL})")
    sv.add_argument("--served-model-name", type=non_empty, default=None,
                    help="model name in the API (default: preset or dir name)")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int_in(0, 65535), default=8000)
    sv.add_argument("--api-key", type=non_empty, default=None,
                    help="require 'Authorization: Bearer KEY' on every route but /health")
    sv.add_argument("--device", default="cpu")
    sv.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    sv.add_argument("--max-num-seqs", type=int, default=64, help="requests in the running batch at most")
    sv.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per engine step at most")
    sv.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    sv.add_argument("--max-queued-requests", type=int_in(0), default=256,
                    help="sequences (prompts x n) waiting beyond --max-num-seqs before new requests get 429")
    sv.add_argument("--max-memory", "--kv-cache-memory-bytes", dest="max_memory", type=int, default=None,
                    help=MAX_MEMORY_HELP + "; --disagg's engine workers share it too")
    sv.add_argument("--mem-fraction-static", type=float, default=0.5,
                    help="fraction of available memory for the cache when --max-memory is not given (at most "
                         "OURO_KV_CACHE_SPACE GiB)")
    sv.add_argument("--page-size", type=int, default=64)
    sv.add_argument("--enable-prefix-caching", action="store_true")
    add_compile_flag(sv)
    add_quantization_flag(sv)
    add_kv_cache_flags(sv)
    add_speculative_flags(sv)
    add_determinism_flag(sv)
    add_parallel_flags(sv)
    sv.add_argument("--cp", "--context-parallel-size", dest="cp", type=int, default=1,
                    help="ranks of a context-parallel prefill: the engine plus N-1 helper processes, each holding the "
                         "model; prompts of --cp-threshold tokens or more are prefilled across them, decode stays on the engine")
    sv.add_argument("--cp-threshold", type=int, default=4096, help="with --cp N: the shortest prompt prefilled across ranks")
    sv.add_argument("--cp-precision", default="auto", choices=["auto", "fp32", "tf32", "tf32x3"],
                    help="with --cp N: precision of the KDA state chain (auto: fp32 on a CPU, tf32x3 on CUDA)")
    sv.add_argument("--cp-chunk-size", type=int, default=0, help="with --cp N: tokens per CP forward (0: whole prompt)")
    sv.add_argument("--cp-layer-split", "--enable-cp-cache-layer-split", dest="cp_layer_split", action="store_true",
                    help="with --cp N: LayerSplit, each helper rank keeps its own block of DSA layers' rows; a layer's "
                         "earlier rows come by broadcast from its owner before use (see --cp-chunk-size)")
    sv.add_argument("--prefix-checkpoint-interval", type=int, default=1, help="pages between KDA checkpoints")
    sv.add_argument("--shutdown-timeout", type=float_at_least(0.0), default=30.0,
                    help="seconds in-flight requests get to finish after SIGTERM")
    sv.add_argument("--max-request-body-bytes", type=int_in(1), default=4 << 20)
    add_media_flags(sv)
    sv.add_argument("--logits-processors", nargs="*", default=[],
                    help="'module:Class' logits processors, each built with the checkpoint directory")
    sv.add_argument("--trace", default=None, metavar="FILE",
                    help="record spans in the frontend and the engine process; merged into FILE (Chrome trace) at exit")
    sv.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    from .disagg.command import add_worker_flags
    add_worker_flags(sv)
    sv.add_argument("--config", default=None, metavar="FILE",
                    help="engine options from a file (`ouro tune --output`); flags given here override it")
    sv.set_defaults(func=_cmd_serve, options_parser=sv)


def build_parser(argv=None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ouro", description="Serve and study GLM-5.3-Flash-class models.")
    sub = p.add_subparsers(dest="command", required=True)
    _add_make_model_parser(sub)
    _add_generate_parser(sub)
    _add_bench_parser(sub)
    add_serve_parser(sub)
    _add_plan_parser(sub)
    add_eval_parser(sub)
    from .train.command import add_train_parser
    add_train_parser(sub)
    from .lab.command import add_lab_parser, add_probe_parser
    argv = sys.argv[1:] if argv is None else argv
    add_probe_parser(sub, with_options=argv[1] if argv[:1] == ["probe"] and len(argv) > 1 else None)
    add_lab_parser(sub)
    from .disagg.command import add_router_parser
    add_router_parser(sub)
    from .agent.command import add_agent_parser
    add_agent_parser(sub)
    from .tune.command import add_tune_parser
    add_tune_parser(sub)
    return p


def _add_make_model_parser(sub) -> None:
    """`ouro make-model PRESET DIR`."""
    mk = sub.add_parser("make-model", help="write a deterministic random-init checkpoint of a preset")
    mk.add_argument("preset", help="tiny | tiny-vl | small | flash (flash: config and tokenizer only)")
    mk.add_argument("directory")
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in DIRECTORY")
    mk.set_defaults(func=_cmd_make_model)


def _add_generate_parser(sub) -> None:
    """`ouro generate [MODEL]`: a prompt continued on the terminal."""
    gen = sub.add_parser("generate", help="greedily continue a prompt, printing tokens as they come")
    gen.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                     help=f"checkpoint directory or preset name (default: {DEFAULT_MODEL})")
    gen.add_argument("--prompt", default="import os\n\n\ndef main(", help="text to continue (the built-in tiny-py continues Python)")
    gen.add_argument("--prompt-token-ids", default=None, help="comma-separated token ids instead of --prompt")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"], help="auto (the fastest native GEMM dtype of this machine, timed once and cached), float32, bfloat16")
    add_quantization_flag(gen)
    add_kv_cache_flags(gen)
    add_speculative_flags(gen)
    add_determinism_flag(gen)
    add_parallel_flags(gen)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--max-memory", "--kv-cache-memory-bytes", dest="max_memory", type=int, default=None,
                     help=MAX_MEMORY_HELP)
    gen.add_argument("--mem-fraction-static", type=float, default=0.5,
                     help="fraction of available memory for the cache when --max-memory is not given (at most "
                          "OURO_KV_CACHE_SPACE GiB)")
    gen.set_defaults(func=_cmd_generate)


def _add_bench_parser(sub) -> None:
    """`ouro bench offline|prefill|serve`."""
    bench = sub.add_parser("bench", help="benchmarks, measured side by side in one run")
    bench.add_argument("kind", choices=["offline", "prefill", "serve"])
    bench.add_argument("--model", default=None, help=f"checkpoint directory or preset name (default: {BENCH_MODEL}); "
                       "serve: the model name sent (default: the server's first in /v1/models)")
    bench.add_argument("--input-len", "--random-input-len", dest="input_len", type=int_in(1), default=256)
    bench.add_argument("--output-len", "--random-output-len", dest="output_len", type=int_in(1), default=64)
    bench.add_argument("--num-prompts", type=int_in(1), default=64)
    bench.add_argument("--max-concurrency", type=int_in(1), default=32)
    bench.add_argument("--repeats", type=int_in(1), default=3)
    from .bench.command import add_bench_prefill_options, add_bench_serve_options, run_bench
    add_bench_prefill_options(bench)
    add_compile_flag(bench)
    bench.add_argument("--baseline", default=None, metavar="REF",
                       help="offline: also run the same workload on git ref REF of this repository (a temporary "
                            "worktree, its own process, same dtype), interleaved with the current tree, "
                            "--repeats times each, and print the speed-up")
    bench.add_argument("--compare", nargs="?", const="transformers", choices=["transformers", "none"],
                       default="none", help="also run transformers on the same work (--compare transformers)")
    bench.add_argument("--output-json", default=None)
    bench.add_argument("--disable-tqdm", action="store_true", help="no progress bars (every kind)")
    bench.add_argument("--device", default="cpu", help="offline: cpu or cuda (both systems run there)")
    bench.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"], help="offline: auto (the fastest native GEMM dtype of this machine, timed once and cached)")
    add_quantization_flag(bench)
    add_speculative_flags(bench)
    add_determinism_flag(bench)
    from .measure.spans import TraceToFile
    bench.add_argument("--trace", default=None, metavar="FILE", action=TraceToFile,
                       help="record the run's spans into FILE (Chrome trace, written at exit)")
    add_bench_serve_options(bench)
    bench.add_argument("--config", default=None, metavar="FILE",
                       help="offline: engine options from a file (`ouro tune --output`), over the flags")
    bench.set_defaults(func=run_bench)


def _add_plan_parser(sub) -> None:
    """`ouro plan`: cache memory per sequence and per device."""
    plan = sub.add_parser("plan", help="cache memory per sequence, and per device under tp / cp, for a model at given context lengths")
    plan.add_argument("--model", default="flash", help="preset name or checkpoint directory")
    plan.add_argument("--context", default="4096,131072,1048576", help="comma-separated context lengths")
    plan.add_argument("--kv-cache-dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    plan.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (weights and KDA state split)")
    plan.add_argument("--ep", type=int, default=1, help="with --tp N: routed experts whole per rank (N = --tp)")
    plan.add_argument("--cp", type=int, default=1, help="context-parallel ranks of one prefill")
    plan.add_argument("--layer-split", action="store_true", help="with --cp N: LayerSplit's DSA rows per helper rank")
    plan.add_argument("--device-memory", default=None, help="memory of one device, e.g. 141GB or 80GiB: how many requests fit")
    plan.add_argument("--prefill-chunk", type=int, default=8192, help="most prompt tokens one rank prefills at once")
    plan.add_argument("--image-size", default="448x448,1024x768,3584x2800", metavar="WxH,...",
                      help="image sizes whose tokens and tower memory to show (a model with a vision tower)")
    plan.set_defaults(func=_cmd_plan)


def main(argv=None) -> int:
    args = build_parser(argv).parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    from .config import CheckpointError
    try:
        return args.func(args)
    except (CheckpointError, ValueError) as e:
        print(f"ouro: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
