"""The engine's command-line flags, defined once for every command that takes them (`serve`,
`generate`, `bench`, `eval`, ...): names follow SGLang's and vLLM's where they have one."""

from __future__ import annotations

import argparse


def int_in(low: int, high: int | None = None):
    """An argparse type: an integer in [low, high] (no upper bound with high None), refused by argparse
    with one line naming the flag before anything loads."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = None
        if v is None or v < low or (high is not None and v > high):
            bound = f"in {low}..{high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {text!r}")
        return v
    return parse


def float_at_least(low: float):
    """An argparse type: a finite number >= low."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = float("nan")
        if not (low <= v < float("inf")):
            raise argparse.ArgumentTypeError(f"must be a number >= {low}, got {text!r}")
        return v
    return parse


def rate(text: str) -> float:
    """An argparse type: requests per second, > 0 (inf: all at once)."""
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0 (inf: all at once), got {text!r}")
    return v


def non_empty(text: str) -> str:
    """An argparse type: a string that is not empty (an empty API key or model name matches nothing)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def add_compile_flag(p) -> None:
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                   help="run decode steps as one torch.compile'd graph at padded batch-size buckets (CUDA graphs on "
                        "a GPU); compiled at start-up: minutes the first time, seconds once inductor's cache holds it")
    p.add_argument("--torch-compile-max-bs", type=int, default=32, metavar="N",
                   help="with --compile: the largest decode batch the graph runs (larger batches run eagerly)")


def add_speculative_flags(p) -> None:
    p.add_argument("--speculative-algorithm", default=None, type=str.upper, choices=["NEXTN", "MTP"],
                   help="speculative decoding with the checkpoint's MTP layer (NEXTN; MTP is an alias)")
    p.add_argument("--speculative-num-steps", type=int, default=3, metavar="K", help="draft tokens per step")
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None, metavar="N",
                   help="tokens verified per step: K + 1 (chains only: if given it must equal --speculative-num-steps + 1)")
    p.add_argument("--speculative-kda-state", default="replay", choices=["replay", "per_step"],
                   help="how a verification keeps the KDA states: replay the accepted prefix from per-position inputs "
                        "(default) or materialise a state per position (the baseline)")
    p.add_argument("--speculative-canary-min-accept-length", type=float, default=None, metavar="L",
                   help="online canary: a request whose mean accept length (tokens per verification) is below L after "
                        "--speculative-canary-after tokens stops speculating")
    p.add_argument("--speculative-canary-max-accept-rate", type=float, default=None, metavar="R",
                   help="online canary: a request accepting more than this fraction of its drafts (a verification that "
                        "accepts everything is broken) stops speculating")
    p.add_argument("--speculative-canary-after", type=int, default=None, metavar="N",
                   help="output tokens before the canary judges a request (default 32)")


def add_parallel_flags(p) -> None:
    p.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1, metavar="N",
                   help="split the weights over N ranks (processes, gloo on a CPU): KDA and attention heads, MLP "
                        "channels, vocabulary")
    p.add_argument("--ep", "--expert-parallel-size", dest="ep", type=int, default=1, metavar="N",
                   help="with --tp N: routed experts whole per rank (N must equal --tp); default: every expert's "
                        "channels split")


def add_determinism_flag(p) -> None:
    p.add_argument("--enable-deterministic-inference", action="store_true",
                   help="batch-invariant kernels: a request's logits do not depend on what it is batched with "
                        "(speculative and plain runs agree bit for bit); slower, not with --compile")


def add_quantization_flag(p) -> None:
    p.add_argument("--quantization", default=None, choices=["w8a8", "fp8"],
                   help="w8a8: int8 weights (per channel) and activations (per token) for the projections and "
                        "experts, exact int32 products (ouro's kernel, built on first use); fp8: the same in float8 "
                        "e4m3 (torch._scaled_mm, the fp8 tensor cores of a GPU)")
    p.add_argument("--quantization-ignore", default=None, metavar="PATTERNS",
                   help="with --quantization: comma-separated module name patterns kept unquantised, replacing the "
                        "default (lm_head,*.indexer.weights_proj,*.kv_b_proj), e.g. 'lm_head,layers.3.*'; *.kv_b_proj "
                        "is always kept (MLA absorbs it into the attention: it never runs as a product)")


def add_kv_cache_flags(p) -> None:
    from . import KV_DTYPES
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_DTYPES,
                   help="the DSA latent and indexer-key cache: auto (the engine dtype), or fp8_e4m3 / int8 rows with "
                        "a float32 scale per 128 values (KDA state stays fp32)")
    p.add_argument("--kv-cache-layer-dtype", default=None, metavar="SPEC",
                   help="per-layer override of --kv-cache-dtype, e.g. '3:fp8_e4m3' or '0-1:bf16,3:int8' (DSA layers)")


def add_media_flags(p) -> None:
    p.add_argument("--limit-mm-per-prompt", default='{"image": 8}', metavar="JSON",
                   help='images a request may carry, e.g. \'{"image": 4}\'')
    p.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="image_url parts may name local files under DIR (off by default; URLs are never fetched)")
    p.add_argument("--max-image-bytes", type=int, default=16 << 20, help="largest encoded image accepted")
    p.add_argument("--max-image-pixels", type=int, default=40_000_000, help="largest width x height accepted")


MAX_MEMORY_HELP = ("cache budget in bytes, the tensor-parallel ranks' caches together (default: --mem-fraction-static "
                   "of the memory available at start, at most OURO_KV_CACHE_SPACE GiB, 4 when unset; pages are "
                   "resident only once used)")
