"""`ouro serve`: resolve the model, start the engine process, then serve HTTP with uvicorn.
SIGTERM/SIGINT drain: /health turns 503 and new requests get 503 at once, in-flight requests
get up to --shutdown-timeout seconds to finish, then are aborted, the engine stops, exit 0."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

from ..config import speculative_args, split_patterns, tp_args


def engine_kwargs(args) -> dict:
    return {"device": args.device, "dtype": args.dtype, "page_size": args.page_size, "max_model_len": args.max_model_len,
            "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_memory": args.max_memory, "memory_fraction": args.mem_fraction_static,
            "compile": bool(getattr(args, "compile", False)),
            "torch_compile_max_bs": getattr(args, "torch_compile_max_bs", 32),
            "context_parallel_size": getattr(args, "cp", 1), "cp_threshold": getattr(args, "cp_threshold", 4096),
            "cp_precision": getattr(args, "cp_precision", "auto"),
            "cp_chunk_size": getattr(args, "cp_chunk_size", 0), "cp_layer_split": bool(getattr(args, "cp_layer_split", False)),
            "quantization": getattr(args, "quantization", None),
            "quantization_ignore": split_patterns(getattr(args, "quantization_ignore", None)),
            "kv_cache_dtype": getattr(args, "kv_cache_dtype", "auto"),
            "kv_cache_layer_dtype": getattr(args, "kv_cache_layer_dtype", None),
            "deterministic_inference": bool(getattr(args, "enable_deterministic_inference", False)),
            "enable_prefix_caching": args.enable_prefix_caching,
            "prefix_checkpoint_interval": args.prefix_checkpoint_interval, **speculative_args(args), **tp_args(args)}


def media_for(args, directory, mc):
    """(the checkpoint's ImagePrompt or None, the image limits of the command line)."""
    from ..engine.multimodal import ImagePrompt
    from ..models.loader import has_vision
    from .media import MediaLimits
    try:
        per_prompt = json.loads(getattr(args, "limit_mm_per_prompt", None) or "{}")
        max_images = int(per_prompt.get("image", 8))
    except (ValueError, TypeError, AttributeError):
        raise ValueError(f"--limit-mm-per-prompt takes JSON like '{{\"image\": 4}}', got "
                         f"{getattr(args, 'limit_mm_per_prompt', None)!r}") from None
    limits = MediaLimits(max_images=max_images, max_bytes=getattr(args, "max_image_bytes", 16 << 20),
                         max_pixels=getattr(args, "max_image_pixels", 40_000_000),
                         allowed_local_path=getattr(args, "allowed_local_media_path", None))
    return (ImagePrompt(directory, mc) if has_vision(directory) else None), limits


def random_init_note(directory: Path) -> str | None:
    marker = directory / "ouro_preset.json"
    if marker.is_file():
        info = json.loads(marker.read_text())
        if info.get("random_init"):
            return (f"ouro: NOTE: {directory} holds the random-init '{info.get('preset')}' preset: its text is "
                    "meaningless; serve a real glm5_next checkpoint with --model DIR")
    return None


def serve(args, make_client=None) -> int:
    """`make_client(directory, on_stats)`: the frontend's handle on what computes (default: an
    `EngineClient` that spawns the engine process from this command's engine flags; `ouro router`
    passes workers)."""
    from ..config import EngineConfig, ModelConfig
    from ..engine.options import check_engine_options
    from ..measure import spans
    from ..models.resolve import resolve_model
    from .api_server import build_app
    from .engine_client import EngineClient

    trace = getattr(args, "trace", None) or spans.trace_path_from_env()
    if trace:   # the engine process reads the same switch and writes FILE.engine.json
        spans.set_env(trace)
        spans.start_from_env(".frontend.json", process_name="ouro frontend")
    directory = resolve_model(args.model, progress=True)
    mc = ModelConfig.from_hf(directory)
    if make_client is None:
        kw = engine_kwargs(args)
        check_engine_options(EngineConfig(**kw), mc)
        make_client = lambda d, on_stats: EngineClient(d, kw, args.logits_processors, on_stats=on_stats)
    state = _server_state(args, directory, mc, make_client)
    return _run(build_app(state), state, args, trace)


def _server_state(args, directory, mc, make_client):
    """What the routes share: the tokenizer and chat format, the limits, the metrics and the
    client of what computes (made here, started by `_run`)."""
    from ..models.resolve import load_tokenizer
    from .chat import ChatFormat
    from .metrics import Metrics
    from .state import ServerState
    from .tokenize_routes import tokenizer_info

    tokenizer = load_tokenizer(directory)
    if tokenizer is None:
        raise ValueError(f"{directory} has no tokenizer.json; the server needs one to turn text into tokens")
    note = random_init_note(Path(directory))
    if note:
        print(note, file=sys.stderr, flush=True)
    name = args.served_model_name or (args.model if not Path(args.model).is_dir() else Path(directory).name)
    metrics = Metrics(name)
    state = ServerState(client=make_client(directory, metrics.update_engine), tokenizer=tokenizer,
                        chat=ChatFormat.from_checkpoint(directory, tokenizer), model_name=name, max_model_len=0,
                        capacity_tokens=0, vocab_size=mc.vocab_size, eos_token_ids=tuple(mc.eos_token_ids),
                        api_key=args.api_key, max_queued_requests=args.max_queued_requests,
                        max_num_seqs=args.max_num_seqs, max_body_bytes=args.max_request_body_bytes, metrics=metrics)
    state.images, state.media = media_for(args, directory, mc)
    state.tokenizer_info = tokenizer_info(directory, tokenizer, state.chat, mc.eos_token_ids)
    return state


def _run(app, state, args, trace) -> int:
    """HTTP up at once (/health answers 503 while the engine loads), the engine started beside it;
    the first signal drains, a second SIGINT forces; the engine stopped on the way out."""
    import uvicorn

    from .engine_client import EngineUnavailable
    client, name = state.client, state.model_name

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # first signal: drain (new requests get 503 at once); a second SIGINT forces. The
            # signal is not re-raised after the drain (uvicorn's default), so the engine is
            # stopped below and the exit status is 0.
            state.draining = True
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout, access_log=False)
    server = Server(config)
    status = [0]

    async def start_engine():
        try:
            await client.start()
        except EngineUnavailable as e:
            print(f"ouro: error: the engine did not start: {e}", file=sys.stderr, flush=True)
            status[0] = 1
            server.should_exit = True
            return
        state.max_model_len, state.capacity_tokens = client.info["max_model_len"], client.info["max_tokens"]
        print(f"ouro: engine process pid {client.info['pid']}; {client.info['plan']}", file=sys.stderr, flush=True)
        print(f"ouro: serving {name!r} on http://{args.host}:{args.port} (OpenAI API under /v1)",
              file=sys.stderr, flush=True)

    async def main():
        starting = asyncio.create_task(start_engine())
        try:
            await server.serve()
        finally:
            starting.cancel()
            await client.shutdown(timeout=30 if trace else 5)   # the engine writes its trace on the way out
            client.cleanup()
            if trace:
                _merge_trace(trace)
        return status[0]

    return asyncio.run(main())


def _merge_trace(path: str) -> None:
    """The frontend's and the engine process's (or the prefill and decode workers') traces, merged
    into one Chrome trace at `path`."""
    from ..measure import spans
    from ..measure.chrome_trace import merge
    spans.save_once(path + ".frontend.json", "ouro frontend")
    merge([path + ".frontend.json", path + ".engine.json", path + ".prefill.json", path + ".decode.json"], path)
    print(f"ouro: wrote the trace {path} (open it in https://ui.perfetto.dev)", file=sys.stderr, flush=True)
