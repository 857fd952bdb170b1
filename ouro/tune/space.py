"""What `ouro tune` searches: the serving options, each a few values, in the order they are tried.

Each option's first choice is the unoptimised engine's. A choice is the EngineConfig fields it
sets (an option's other choices' fields go back to their defaults when it is picked). `exact`
options may not change greedy outputs (checked against the same configuration without them);
the others may, within the held-out bits/byte budget. Options the machine or the model cannot
take (TP beyond the cores, speculation without an MTP layer) are left out, with the reason.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..quant.w8a8 import UNQUANTISED


@dataclass(frozen=True)
class Option:
    name: str
    choices: tuple           # ((label, {EngineConfig field: value}), ...); the first is the baseline
    exact: bool
    motivation: str = ""     # the lab finding behind it (filled by `motivations`)

    def fields(self) -> set[str]:
        return {k for _, f in self.choices for k in f}


@dataclass
class Space:
    options: list[Option]
    left_out: dict = field(default_factory=dict)       # option -> why


BASELINE = {"dtype": "float32"}       # the unoptimised engine: float32, eager, unquantised, one rank


HEAD_TOO = tuple(p for p in UNQUANTISED if p != "lm_head")    # quantisation's default keep-list less the head

SLOW_GEMM = 0.5       # a dtype whose measured GEMM rate is below this share of float32's is not tried


def search_space(model_config, concurrency: int, cores: int | None = None, gemm_rates: dict | None = None,
                 input_len: int | None = None) -> Space:
    """gemm_rates: {dtype: GFLOP/s} measured on this machine (`dtype_pick`, what `--dtype auto`
    reads); a 16-bit dtype far below float32's is left out with the figures, not timed (one
    workload run at its rate would take minutes). input_len: the workload's prompt length, for the
    token budget that takes one whole prompt a step beside every running request's decode row (on a
    CPU a prompt's prefill costs about the same alone as in a batch: waiting prompts taken one by
    one get their first tokens sooner, at some cost in throughput)."""
    cores = cores or os.cpu_count() or 1
    left_out = {}
    dtypes = [("float32", {})]
    for dt in ("bfloat16",):
        rate, fp32 = (gemm_rates or {}).get(dt), (gemm_rates or {}).get("float32")
        if rate is not None and fp32 and rate < SLOW_GEMM * fp32:
            left_out[f"dtype={dt}"] = f"its GEMM runs at {rate:.2f} GFLOP/s here against float32's {fp32:.1f}"
        else:
            dtypes.append((dt, {"dtype": dt}))
    opts = [
        Option("dtype", tuple(dtypes), exact=False),
        Option("quantization", (("none", {}), ("w8a8", {"quantization": "w8a8"}), ("fp8", {"quantization": "fp8"}),
                                # the output layer too: at decode it is a third of the step's products
                                ("w8a8 with the head", {"quantization": "w8a8", "quantization_ignore": HEAD_TOO})),
               exact=False),
        Option("kv_cache_dtype", (("auto", {}), ("int8", {"kv_cache_dtype": "int8"}),
                                  ("fp8_e4m3", {"kv_cache_dtype": "fp8_e4m3"})), exact=False),
        Option("max_num_batched_tokens", budgets(concurrency, input_len), exact=True),
        Option("page_size", (("64", {}), ("16", {"page_size": 16}), ("128", {"page_size": 128})), exact=True),
    ]
    if model_config.has_mtp:
        opts.append(Option("speculation", (("off", {}),) + tuple(
            (f"NEXTN K={k}", {"speculative_algorithm": "NEXTN", "speculative_num_steps": k}) for k in (1, 2, 3)),
            exact=True))
    else:
        left_out["speculation"] = "the checkpoint has no MTP layer"
    if cores >= 2:
        from ..parallel.tp_shard import check_split
        tps = []
        for ep in (False, True):
            try:
                check_split(model_config, 2, ep)
                tps.append((f"tp=2{' ep=2' if ep else ''}", {"tensor_parallel_size": 2, "expert_parallel": ep}))
            except ValueError as e:
                left_out[f"tp=2{' ep=2' if ep else ''}"] = str(e)
        if tps:
            opts.append(Option("parallelism", (("tp=1", {}),) + tuple(tps), exact=True))
    else:
        left_out["parallelism"] = f"{cores} core: no second rank"
    # last: a compiled candidate compiles its own graphs (minutes on 2 cores), so it is tried once,
    # on top of everything else, rather than under every later candidate
    opts.append(Option("compile", (("off", {}), ("on", {"compile": True, "torch_compile_max_bs": concurrency})),
                       exact=True))
    return Space([o for o in opts if len(o.choices) > 1], left_out)


def budgets(concurrency: int, input_len: int | None) -> tuple:
    """The token budgets tried: the default, a small and a large one, and one prompt a step."""
    out = [("2048", {}), ("512", {"max_num_batched_tokens": 512}), ("8192", {"max_num_batched_tokens": 8192})]
    if input_len:
        one = input_len + concurrency
        if str(one) not in {label for label, _ in out}:
            out.append((f"{one} (one prompt a step)", {"max_num_batched_tokens": one}))
    return tuple(out)


def apply(config: dict, option: Option, choice: dict) -> dict:
    """`config` with `option` set to `choice` (its other fields back to the defaults)."""
    out = {k: v for k, v in config.items() if k not in option.fields()}
    return {**out, **choice}


def choice_of(config: dict, option: Option) -> str:
    """The label of the option's choice that `config` holds."""
    same = lambda a, b: (list(a) if isinstance(a, tuple) else a) == (list(b) if isinstance(b, tuple) else b)  # noqa: E731 (a journal's JSON has lists)
    for label, f in reversed(option.choices):
        if f and all(same(config.get(k), v) for k, v in f.items()):
            return label
    return option.choices[0][0]


def lossy_fields(config: dict, space: Space) -> dict:
    """The fields of `config` that may change outputs (what the quality budget checks)."""
    names = set().union(*(o.fields() for o in space.options if not o.exact))
    return {k: v for k, v in config.items() if k in names}
