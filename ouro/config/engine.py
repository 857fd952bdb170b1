"""How the engine runs a model (`EngineConfig`), the per-layer KV-cache policy it is given, and the
command line's speculative and pattern options turned into its fields."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .model import KV_DTYPES, KV_QUANTISED, ModelConfig, _is_int


def parse_layer_kv(text: str | None) -> dict[int, str]:
    """'0-1:bf16,3:fp8_e4m3' (SGLang's syntax) -> {0: 'bf16', 1: 'bf16', 3: 'fp8_e4m3'}."""
    out = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        layers, colon, kind = part.partition(":")
        lo, dash, hi = layers.strip().partition("-")
        if not colon or kind.strip() not in KV_DTYPES or not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"--kv-cache-layer-dtype takes LAYER[-LAYER]:DTYPE,... with DTYPE one of "
                             f"{', '.join(KV_DTYPES)}, got {part!r}")
        for i in range(int(lo), int(hi if dash else lo) + 1):
            out[i] = kind.strip()
    return out


def speculative_args(args) -> dict:
    """EngineConfig fields from the command line's speculative flags (SGLang's names), checked
    against each other; {} without --speculative-algorithm."""
    algo = getattr(args, "speculative_algorithm", None)
    if not algo:
        return {}
    k, n = args.speculative_num_steps, getattr(args, "speculative_num_draft_tokens", None)
    if n is not None and n != k + 1:
        raise ValueError(f"--speculative-num-draft-tokens {n} must be --speculative-num-steps + 1 = {k + 1} "
                         "(ouro drafts one chain: no tree)")
    out = {"speculative_algorithm": algo, "speculative_num_steps": k,
           "speculative_kda_state": getattr(args, "speculative_kda_state", "replay")}
    for name in ("speculative_canary_min_accept_length", "speculative_canary_max_accept_rate", "speculative_canary_after"):
        if getattr(args, name, None) is not None:
            out[name] = getattr(args, name)
    return out


def tp_args(args) -> dict:
    """EngineConfig fields from the command line's --tp / --ep, checked against each other."""
    tp, ep = getattr(args, "tp", 1), getattr(args, "ep", 1)
    if ep not in (1, tp):
        raise ValueError(f"--ep {ep} must be 1 or equal --tp ({tp}): experts are sharded over the tensor-parallel ranks")
    return {"tensor_parallel_size": tp, "expert_parallel": ep > 1}


def split_patterns(text: str | None) -> tuple | None:
    """'a, b.*' -> ('a', 'b.*'); None stays None (a command line's comma-separated patterns)."""
    return None if text is None else tuple(p.strip() for p in text.split(",") if p.strip())


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model: device, dtype, memory and batching budgets."""
    device: str = "cpu"
    dtype: str = "auto"  # auto: the fastest native GEMM dtype, measured (ouro.machine.dtype_pick)
    page_size: int = 64
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_memory: int | None = None      # cache budget in bytes; None: memory_fraction of free memory
    memory_fraction: float = 0.5
    kda_chunk_size: int = 16
    seed: int = 0
    compile: bool = False              # run decode steps as a compiled graph (ouro.engine.decode_graph)
    torch_compile_max_bs: int = 32     # the largest decode batch the graph runs (larger ones run eagerly)
    tensor_parallel_size: int = 1      # ranks the weights are split over (ouro.parallel.tp_shard, ouro.engine.tp_workers)
    expert_parallel: bool = False      # with tensor parallelism: routed experts whole per rank (else channels split)
    context_parallel_size: int = 1     # ranks of a context-parallel prefill (ouro.parallel.cp_prefill)
    cp_threshold: int = 4096           # prompts of at least this many tokens take the CP prefill
    cp_precision: str = "auto"         # the KDA state chain's precision; auto: fp32 on a CPU, tf32x3 on CUDA
    cp_chunk_size: int = 0             # tokens per CP forward of a long prompt (0: the whole prompt in one)
    cp_layer_split: bool = False       # LayerSplit: each CP helper rank keeps its own DSA layers' rows only
    quantization: str | None = None    # w8a8 (int8) or fp8 (e4m3) projections and experts (ouro.quant), on the built model
    quantization_ignore: tuple | None = None   # module name patterns kept unquantised; None: ouro.quant's default
    kv_cache_dtype: str = "auto"       # DSA latent + indexer-key cache: auto (the engine dtype), fp8_e4m3, int8
    kv_cache_layer_dtype: str | None = None    # per-layer override, "0-1:bf16,3:fp8_e4m3"
    # speculative decoding with the checkpoint's MTP layer (ouro.engine.speculative): NEXTN (alias MTP)
    speculative_algorithm: str | None = None
    speculative_num_steps: int = 3     # draft tokens per step (K)
    speculative_kda_state: str = "replay"   # replay: per-position inputs, the accepted prefix replayed; per_step: a state per position
    # the online canary: after `after` output tokens a request whose mean accept length is below the
    # floor, or whose acceptance rate is above the ceiling (a verification accepting everything), stops speculating
    speculative_canary_min_accept_length: float = 0.0
    speculative_canary_max_accept_rate: float = 1.0
    speculative_canary_after: int = 32
    # batch-invariant kernels (ouro.ops.batch_invariant): a row's logits do not depend on its batch,
    # so speculative and plain runs, batch 1 and batch 16, agree bit for bit; slower, eager only
    deterministic_inference: bool = False
    # prefix caching (ouro.engine.prefix_cache): full prompt pages shared between requests, with a
    # KDA-state checkpoint every `prefix_checkpoint_interval` pages (the states cannot be rebuilt from rows)
    enable_prefix_caching: bool = False
    prefix_checkpoint_interval: int = 1

    DTYPES = ("auto", "float32", "bfloat16", "float16")
    QUANTIZATIONS = ("w8a8", "fp8")
    SPECULATIVE = {"NEXTN": "NEXTN", "MTP": "NEXTN"}

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Every option checked up front, naming the option and its allowed range."""
        def count(name, minimum=1, optional=False):
            v = getattr(self, name)
            if optional and v is None:
                return
            if not _is_int(v) or v < minimum:
                raise ValueError(f"{name} must be an integer >= {minimum}{' or None' if optional else ''}, got {v!r}")
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "kda_chunk_size", "torch_compile_max_bs",
                     "context_parallel_size", "cp_threshold", "tensor_parallel_size"):
            count(name)
        if self.quantization is not None and self.quantization not in self.QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(self.QUANTIZATIONS)} or None, got {self.quantization!r}")
        if isinstance(self.quantization_ignore, str):     # iterated, a string is its letters: each a pattern
            raise ValueError(f"quantization_ignore must be a list of module name patterns, got the string "
                             f"{self.quantization_ignore!r}; e.g. ({self.quantization_ignore!r},), or in a config "
                             f"file quantization_ignore = [{self.quantization_ignore!r}]")
        if self.quantization_ignore is not None and not all(isinstance(p, str) for p in self.quantization_ignore):
            raise ValueError(f"quantization_ignore must be module name patterns (strings), got {self.quantization_ignore!r}")
        if self.kv_cache_dtype not in KV_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_cache_dtype!r}")
        parse_layer_kv(self.kv_cache_layer_dtype)
        if self.cp_precision not in ("auto", "fp32", "tf32", "tf32x3"):
            raise ValueError(f"cp_precision must be one of auto, fp32, tf32, tf32x3, got {self.cp_precision!r}")
        count("max_model_len", optional=True)
        count("max_memory", optional=True)
        count("cp_chunk_size", minimum=0)
        if not _is_int(self.prefix_checkpoint_interval) or self.prefix_checkpoint_interval < 1:
            raise ValueError("prefix checkpoint_interval must be an integer >= 1 (pages), got "
                             f"{self.prefix_checkpoint_interval!r}")
        if self.enable_prefix_caching and self.prefix_checkpoint_interval * self.page_size > self.max_num_batched_tokens:
            raise ValueError(f"the prefix-cache checkpoint interval ({self.prefix_checkpoint_interval} pages x page_size "
                             f"{self.page_size}) must fit in max_num_batched_tokens ({self.max_num_batched_tokens}), "
                             "or prefill could never reach a checkpoint")
        for name in ("compile", "deterministic_inference", "expert_parallel", "cp_layer_split", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.speculative_algorithm is not None and str(self.speculative_algorithm).upper() not in self.SPECULATIVE:
            raise ValueError(f"speculative_algorithm must be NEXTN (alias MTP) or None, got {self.speculative_algorithm!r}")
        count("speculative_num_steps")
        count("speculative_canary_after")
        if not isinstance(self.speculative_canary_min_accept_length, (int, float)) or self.speculative_canary_min_accept_length < 0:
            raise ValueError("speculative_canary_min_accept_length must be a number >= 0 (0: off), "
                             f"got {self.speculative_canary_min_accept_length!r}")
        if not isinstance(self.speculative_canary_max_accept_rate, (int, float)) or not 0 < self.speculative_canary_max_accept_rate <= 1:
            raise ValueError("speculative_canary_max_accept_rate must be in (0, 1] (1: off), "
                             f"got {self.speculative_canary_max_accept_rate!r}")
        if self.speculative_kda_state not in ("replay", "per_step"):
            raise ValueError(f"speculative_kda_state must be replay or per_step, got {self.speculative_kda_state!r}")
        if not _is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        f = self.memory_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {f!r}")
        if self.dtype not in self.DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(self.DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")

    def chain_precision(self) -> str:
        """The most accurate KCP chain precision the device runs fast: float32 products on a CPU
        (TF32 is no faster there), three TF32 products on a GPU's tensor cores."""
        if self.cp_precision != "auto":
            return self.cp_precision
        return "tf32x3" if self.device.startswith("cuda") else "fp32"

    def check_device(self) -> None:
        """The device exists on this machine (checked when an engine is built, not in the dataclass)."""
        import torch
        if self.device.startswith("cuda"):
            if not torch.cuda.is_available():
                raise ValueError(f"device {self.device!r} asked for, but this machine has no CUDA device "
                                 "(torch.cuda.is_available() is False); use --device cpu")
            index = int(self.device.split(":")[1]) if ":" in self.device else 0
            if index >= torch.cuda.device_count():
                raise ValueError(f"device {self.device!r}: only {torch.cuda.device_count()} CUDA device(s) here")

    def kv_kinds(self, model: ModelConfig) -> dict[int, str]:
        """{DSA layer id: "fp8_e4m3" | "int8"} for the layers whose cache rows are quantised; the
        rest keep the engine dtype (a float name in the flags means exactly that)."""
        per_layer = parse_layer_kv(self.kv_cache_layer_dtype)
        bad = sorted(set(per_layer) - set(model.dsa_layers))
        if bad:
            raise ValueError(f"--kv-cache-layer-dtype names layer(s) {bad} that are not DSA (indexed attention) "
                             f"layers; the DSA layers are {model.dsa_layers} (KDA layers keep fp32 state)")
        kinds = {layer: per_layer.get(layer, self.kv_cache_dtype) for layer in model.dsa_layers}
        return {layer: k for layer, k in kinds.items() if k in KV_QUANTISED}

    def torch_dtype(self):
        import torch
        if self.dtype == "auto":
            from ..machine.dtype_pick import pick_dtype    # measured once per machine, then cached
            return getattr(torch, pick_dtype(self.device))
        return getattr(torch, self.dtype)
