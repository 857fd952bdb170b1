"""The disaggregation commands: `ouro serve --role encode|prefill|decode` (a worker), `ouro router`
(the OpenAI front over workers) and `ouro serve --disagg [XE]YPZD` (all of them on this host).

Flags follow SGLang's PD disaggregation where they map: `--disaggregation-mode` (our `--role`),
`--disaggregation-transfer-backend` (tcp or shm here), `--disaggregation-bootstrap-port` (the
decode worker's KV receiver port).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time


def add_worker_flags(sv) -> None:
    g = sv.add_argument_group("disaggregation", "prefill/decode workers (see `ouro router`)")
    g.add_argument("--role", "--disaggregation-mode", dest="role", default=None, choices=["encode", "prefill", "decode"],
                   help="run an encode (vision tower only), prefill or decode worker instead of a server: the engine "
                        "protocol over TCP on --host:--port (messages in) and --port+1 (out), for `ouro router`")
    g.add_argument("--encoder-cache-mb", type=int, default=256,
                   help="prefill: MiB of image rows from encode workers kept for reuse (least recently used out)")
    g.add_argument("--disaggregation-transfer-backend", "--transfer-backend", dest="transfer_backend", default="tcp",
                   choices=["tcp", "shm", "mooncake"],
                   help="decode: how prefilled state arrives (shm: same host only; mooncake: Mooncake's "
                        "TransferEngine, needs the mooncake-transfer-engine package)")
    g.add_argument("--disaggregation-bootstrap-port", dest="bootstrap_port", type=int, default=0,
                   help="decode: the port of its KV receiver (default: any free one; the router learns it)")
    g.add_argument("--transfer-timeout", type=float, default=30.0,
                   help="seconds a room waits for its prefill worker, and a prefill worker for its room, "
                        "before the handshake gives it up")
    g.add_argument("--disagg", default=None, metavar="[XE]YPZD",
                   help="start X encode (optional), Y prefill and Z decode workers on this host and serve them "
                        "through a router on --host:--port, e.g. 1P1D or 1E1P1D")
    g.add_argument("--exit-with-parent", action="store_true", help=argparse.SUPPRESS)   # --disagg's own workers
    g.add_argument("--port-file", default=None, help=argparse.SUPPRESS)   # a launcher's worker: its bound --port (0: any pair)


def add_router_parser(sub) -> None:
    from ..models.resolve import DEFAULT_MODEL
    r = sub.add_parser("router", help="OpenAI-compatible front over prefill and decode workers")
    r.add_argument("--prefill", action="append", required=True, metavar="HOST:PORT", help="a prefill worker (repeatable)")
    r.add_argument("--decode", action="append", required=True, metavar="HOST:PORT", help="a decode worker (repeatable)")
    r.add_argument("--encode", action="append", default=[], metavar="HOST:PORT",
                   help="an encode worker (repeatable): image requests go encode -> prefill -> decode; without one "
                        "the prefill workers encode images themselves")
    r.add_argument("--model", default=DEFAULT_MODEL, help="the checkpoint the workers serve (its tokenizer and template)")
    r.add_argument("--served-model-name", default=None)
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=int, default=8000)
    r.add_argument("--api-key", default=None)
    r.add_argument("--max-num-seqs", type=int, default=64)
    r.add_argument("--max-queued-requests", type=int, default=256)
    r.add_argument("--max-request-body-bytes", type=int, default=4 << 20)
    r.add_argument("--shutdown-timeout", type=float, default=30.0)
    r.add_argument("--worker-timeout", type=float, default=10.0,
                   help="seconds without a worker's heartbeat before its requests fail and it counts as down")
    r.add_argument("--trace", default=None, metavar="FILE")
    r.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    r.set_defaults(func=_cmd_router, logits_processors=[])


def _cmd_router(args) -> int:
    from ..serve.server import serve
    from .router_client import DisaggClient
    return serve(args, lambda directory, on_stats: DisaggClient(args.prefill, args.decode, on_stats,
                                                                heartbeat_timeout_s=args.worker_timeout,
                                                                encode=args.encode, model_dir=directory))


def free_port_pair() -> int:
    """A port p with p and p + 1 free now, for a worker that must come back on the same address
    (a restart); a launcher's own workers choose theirs (`spawn_workers`)."""
    import socket
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no pair of free ports found")


def spawn_workers(argvs: list[list[str]], started: list | None = None, timeout_s: float = 300.0, quiet: bool = False,
                  env: dict | None = None) -> list[tuple[subprocess.Popen, int]]:
    """Start workers (each `argv` an `ouro serve --role ...` command line without `--port`) that each
    bind a free pair of ports themselves (`--port 0`), and wait until all have: (process, port)
    each. No other process can take a port between its choice and its bind, as one could when a
    launcher picked free ports and handed them over. `started`: each process is appended as it
    starts, so a caller can stop them all if one fails. `quiet`: their output discarded."""
    import tempfile
    started = [] if started is None else started
    with tempfile.TemporaryDirectory(prefix="ouro-ports-") as d:
        paths = [os.path.join(d, str(i)) for i in range(len(argvs))]
        procs = []
        for argv, path in zip(argvs, paths):
            out = subprocess.DEVNULL if quiet else None
            procs.append(subprocess.Popen(argv + ["--port", "0", "--port-file", path], stdout=out, stderr=out, env=env))
            started.append(procs[-1])
        deadline = time.monotonic() + timeout_s
        for argv, proc, path in zip(argvs, procs, paths):
            what = " ".join(argv[argv.index("--role"):argv.index("--role") + 2]) if "--role" in argv else "worker"
            while not os.path.exists(path):
                if proc.poll() is not None:
                    raise RuntimeError(f"the worker ({what}) exited during start-up (code {proc.returncode})")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the worker ({what}) bound no port within {timeout_s:.0f} s")
                time.sleep(0.05)
        ports = []
        for path in paths:
            with open(path) as f:
                ports.append(int(f.read()))
    return list(zip(procs, ports))


def parse_layout(text: str) -> tuple[int, int, int]:
    """(encode, prefill, decode) workers of `[XE]YPZD`."""
    m = re.fullmatch(r"(?:(\d+)E)?(\d+)P(\d+)D", text.strip().upper())
    if not m or int(m[2]) < 1 or int(m[3]) < 1 or (m[1] is not None and int(m[1]) < 1):
        raise ValueError(f"--disagg takes [XE]YPZD with X, Y, Z >= 1 (e.g. 1P1D or 1E1P1D), got {text!r}")
    return int(m[1] or 0), int(m[2]), int(m[3])


def worker_argv(args, role: str, port: int | None = None) -> list[str]:
    """The `ouro serve --role ...` command line of one local worker, from this serve's engine flags
    (`port` None: none given, `spawn_workers` adds its own)."""
    argv = [sys.executable, "-m", "ouro.cli", "serve", "--role", role, "--model", str(args.model), "--host", "127.0.0.1",
            "--device", args.device, "--transfer-timeout", str(args.transfer_timeout)]
    if port is not None:
        argv += ["--port", str(port)]
    if role == "encode":                 # the tower alone: none of the engine's flags apply
        return argv + ["--exit-with-parent"]
    argv += ["--dtype", args.dtype, "--page-size", str(args.page_size),
             "--encoder-cache-mb", str(getattr(args, "encoder_cache_mb", 256)),
             "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--transfer-backend", args.transfer_backend, "--exit-with-parent"]
    if args.max_memory:
        argv += ["--max-memory", str(args.max_memory)]
    if args.enable_prefix_caching:
        argv += ["--enable-prefix-caching"]
    if getattr(args, "quantization", None):
        argv += ["--quantization", args.quantization]     # both sides run the same products
    if getattr(args, "quantization_ignore", None):
        argv += ["--quantization-ignore", args.quantization_ignore]
    if getattr(args, "kv_cache_dtype", "auto") != "auto":
        argv += ["--kv-cache-dtype", args.kv_cache_dtype]     # the same cache rows on both sides
    if getattr(args, "kv_cache_layer_dtype", None):
        argv += ["--kv-cache-layer-dtype", args.kv_cache_layer_dtype]
    if args.max_model_len:
        argv += ["--max-model-len", str(args.max_model_len)]
    if role == "prefill" and getattr(args, "cp", 1) > 1:     # long prompts across CP ranks, on the prefill side
        argv += ["--cp", str(args.cp), "--cp-threshold", str(args.cp_threshold), "--cp-chunk-size",
                 str(args.cp_chunk_size), "--cp-precision", args.cp_precision]
        argv += ["--cp-layer-split"] if args.cp_layer_split else []
    if getattr(args, "tp", 1) > 1:          # each worker runs its own ranks
        argv += ["--tp", str(args.tp), "--ep", str(getattr(args, "ep", 1))]
    if getattr(args, "enable_deterministic_inference", False):   # both sides: a prefill row equals a decode row
        argv += ["--enable-deterministic-inference"]
    if getattr(args, "speculative_algorithm", None):   # both sides: the cache holds the draft layer's rows
        argv += ["--speculative-algorithm", args.speculative_algorithm,
                 "--speculative-num-steps", str(args.speculative_num_steps),
                 "--speculative-kda-state", args.speculative_kda_state]
        for flag in ("min_accept_length", "max_accept_rate", "after"):
            value = getattr(args, f"speculative_canary_{flag}", None)
            if value is not None:
                argv += [f"--speculative-canary-{flag.replace('_', '-')}", str(value)]
    return argv


def shared_budget(args, n_engines: int):
    """The workers' arguments, with one cache budget for this host measured here once (--max-memory,
    else the engine's default) and split between the `n_engines` prefill and decode workers (each as
    its --max-memory): workers that each measured would see the same free memory and each take it."""
    from ..engine.memory import default_budget
    if args.max_memory:
        total, source = args.max_memory, "--max-memory"
    else:
        total, source = default_budget(args.device, args.mem_fraction_static)
        source = "default: " + source
    share = total // n_engines
    print(f"ouro: --disagg cache budget {total / 2**30:.2f} GiB ({source}), shared by {n_engines} prefill and "
          f"decode workers: {share / 2**30:.2f} GiB each", file=sys.stderr, flush=True)
    return argparse.Namespace(**{**vars(args), "max_memory": share})


def serve_disagg(args) -> int:
    """`ouro serve --disagg XPYD`: the workers as child processes, then the router in this one."""
    from ..serve.server import serve
    from .router_client import DisaggClient
    if getattr(args, "tp", 1) > 1 and args.transfer_backend != "tcp":
        raise ValueError("--disagg with --tp sends each rank's shard over tcp: drop --transfer-backend "
                         f"{args.transfer_backend}")
    n_encode, n_prefill, n_decode = parse_layout(args.disagg)
    workers = shared_budget(args, n_prefill + n_decode)
    layout = [role for role, n in (("encode", n_encode), ("prefill", n_prefill), ("decode", n_decode)) for _ in range(n)]
    started, procs, roles = [], {}, {"encode": [], "prefill": [], "decode": []}
    try:
        for role, (proc, port) in zip(layout, spawn_workers([worker_argv(workers, role) for role in layout], started)):
            procs[f"127.0.0.1:{port}"] = proc
            roles[role].append(f"127.0.0.1:{port}")
        return serve(args, lambda directory, on_stats: DisaggClient(roles["prefill"], roles["decode"], on_stats, procs,
                                                                    encode=roles["encode"], model_dir=directory))
    finally:
        stop_all(started)


def stop_all(procs, timeout_s: float = 10.0) -> None:
    """SIGTERM every process still running, then wait; one that does not stop in time is killed."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_role(args) -> int:
    """`ouro serve --role encode|prefill|decode`."""
    from ..models.resolve import resolve_model
    from ..serve.server import engine_kwargs
    from .worker import run_worker
    if args.cp > 1 and args.role != "prefill":
        raise ValueError(f"--role {args.role} does not combine with --cp: only a prefill worker prefills long prompts")
    directory = resolve_model(args.model, progress=True)
    if args.role == "encode":
        from ..models.loader import has_vision
        from .encode_worker import run_encoder
        if not has_vision(directory):
            raise ValueError(f"{directory} has no vision tower (no model.visual.* tensors): an encode worker needs one")
        if getattr(args, "tp", 1) > 1:
            raise ValueError("an encode worker runs the vision tower on one device: drop --tp")
        run_encoder(str(directory), args.host, args.port, args.device, args.transfer_timeout, args.exit_with_parent,
                    args.port_file)
        return 0
    run_worker(args.role, str(directory), engine_kwargs(args), args.host, args.port, args.transfer_backend,
               args.bootstrap_port, args.transfer_timeout, args.exit_with_parent, args.encoder_cache_mb << 20,
               args.port_file)
    return 0
