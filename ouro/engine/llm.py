"""Offline API, vLLM style: `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import EngineConfig, ModelConfig
from .llm_engine import LLMEngine
from .options import check_engine_options
from .sampling import SamplingParams


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None
    logprobs: list[float] | None
    top_logprobs: list | None


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    cached_tokens: int
    prompt_logprobs: list | None = None   # SamplingParams.prompt_logprobs: [None, {id: logprob}, ...]

    # the first completion's fields, for the common n=1 case
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def usage(self) -> dict:
        completion = sum(len(o.token_ids) for o in self.outputs)
        return {"prompt_tokens": len(self.prompt_token_ids), "completion_tokens": completion,
                "total_tokens": len(self.prompt_token_ids) + completion, "cached_tokens": self.cached_tokens}


def speculative_options(spec: dict | None) -> dict:
    """vLLM's `speculative_config` ({"method": "mtp" | "nextn", "num_speculative_tokens": K,
    "kda_state": "replay" | "per_step"}) -> EngineConfig fields."""
    if not spec:
        return {}
    if not isinstance(spec, dict):
        raise ValueError(f"speculative_config must be a dict, got {type(spec).__name__}")
    canary = {"canary_min_accept_length", "canary_max_accept_rate", "canary_after"}
    unknown = set(spec) - {"method", "num_speculative_tokens", "kda_state"} - canary
    if unknown:
        raise ValueError(f"speculative_config: unknown keys {sorted(unknown)} (method, num_speculative_tokens, "
                         f"kda_state, {', '.join(sorted(canary))})")
    out = {"speculative_algorithm": str(spec.get("method", "mtp")).upper()}
    if "num_speculative_tokens" in spec:
        out["speculative_num_steps"] = spec["num_speculative_tokens"]
    if "kda_state" in spec:
        out["speculative_kda_state"] = spec["kda_state"]
    for key in canary & set(spec):
        out[f"speculative_{key}"] = spec[key]
    return out


class LLM:
    def __init__(self, model: str, device: str = "cpu", dtype: str = "auto", max_memory: int | None = None,
                 memory_fraction: float = 0.5,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048, page_size: int = 64,
                 enable_prefix_caching: bool = False, prefix_checkpoint_interval: int = 1, seed: int = 0,
                 verbose: bool = False, compile: bool = False, torch_compile_max_bs: int = 32,
                 quantization: str | None = None, quantization_ignore: tuple | None = None,
                 kv_cache_dtype: str = "auto", kv_cache_layer_dtype: str | None = None,
                 speculative_config: dict | None = None, enable_deterministic_inference: bool = False,
                 tensor_parallel_size: int = 1, enable_expert_parallel: bool = False, max_model_len: int | None = None,
                 config: str | None = None):
        """max_memory: the cache budget in bytes, every tensor-parallel rank's cache together (None:
        `memory_fraction` of the memory available, at most OURO_KV_CACHE_SPACE GiB, 4 when unset;
        `engine.memory`). max_model_len: the context length (None: the model's); the cache never plans
        more pages than max_num_seqs sequences of it use.
        config: a config file (`ouro tune --output`); an argument given here with a value other
        than its default overrides the file's."""
        import dataclasses

        from ..models.resolve import load_tokenizer
        from ..models.loader import load_model
        from ..models.resolve import resolve_model
        fields = dict(device=device, dtype=dtype, max_memory=max_memory, memory_fraction=memory_fraction,
                      max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=max_num_batched_tokens, page_size=page_size, seed=seed,
                      enable_prefix_caching=enable_prefix_caching, prefix_checkpoint_interval=prefix_checkpoint_interval,
                      compile=compile, torch_compile_max_bs=torch_compile_max_bs, quantization=quantization,
                      quantization_ignore=quantization_ignore, kv_cache_dtype=kv_cache_dtype,
                      kv_cache_layer_dtype=kv_cache_layer_dtype, deterministic_inference=enable_deterministic_inference,
                      tensor_parallel_size=tensor_parallel_size, expert_parallel=enable_expert_parallel,
                      max_model_len=max_model_len,
                      **speculative_options(speculative_config))
        if config is not None:
            from ..config.file import load_config_file
            defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
            given = {k: v for k, v in fields.items() if v != defaults.get(k)}
            fields = {**defaults, **load_config_file(config), **given}
        cfg = EngineConfig(**fields)
        directory = resolve_model(model, progress=verbose)
        # options checked against the model's config before any weight is read
        check_engine_options(cfg, ModelConfig.from_hf(directory))
        weights = load_model(directory, dtype=cfg.torch_dtype(), device=device, kda_chunk_size=cfg.kda_chunk_size)
        self._calls = 0
        self.engine = LLMEngine(weights, load_tokenizer(directory), cfg, verbose=verbose, model_dir=directory,
                                options_checked=True)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[GenerationResult]:
        """One result per prompt. The whole call is validated before anything is queued, and on
        any exception (a bad prompt, a failing step, KeyboardInterrupt) this call's requests are
        aborted, so the engine stays usable and correct for the next call."""
        if isinstance(prompts, (bytes, bytearray)):
            raise TypeError("prompts must be text (str), a dict or a list of them, got bytes: decode them first")
        single = isinstance(prompts, (str, dict))
        prompts = [prompts] if single else list(prompts)
        params = SamplingParams() if params is None else params
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams; pass one "
                                 "SamplingParams for all prompts or a list of the same length")
            plist = list(params)
        else:
            plist = [params] * len(prompts)
        for sp in plist:
            if not isinstance(sp, SamplingParams):
                raise ValueError(f"params must be SamplingParams, got {type(sp).__name__}")
            sp.validate()
        jobs = [(p, sp.child(k)) for p, sp in zip(prompts, plist) for k in range(sp.n)]
        for p, child in jobs:                      # every request checked before any is queued
            self.engine.check_request(p, child)
        if not jobs:                               # no prompts: no results (as vLLM answers it)
            return []
        ids = []
        while not ids or any(r in self.engine.requests for r in ids):   # names nobody else holds
            self._calls += 1
            ids = [f"gen-{id(self):x}-{self._calls}-{j}" for j in range(len(jobs))]
        finished = {}
        from tqdm import tqdm
        bar = tqdm(total=len(jobs), desc="generate", disable=not use_tqdm)
        try:
            for rid, (p, child) in zip(ids, jobs):
                self.engine.add_request(p, child, rid)
            while any(r not in finished for r in ids):
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise
        finally:
            bar.close()
        results, j = [], 0
        for sp in plist:
            outs = [finished[r] for r in ids[j:j + sp.n]]
            comps = [CompletionOutput(k, o.text, o.token_ids, o.finish_reason, o.stop_reason, o.logprobs,
                                      o.top_logprobs) for k, o in enumerate(outs)]
            results.append(GenerationResult(ids[j], outs[0].prompt_token_ids, comps, outs[0].cached_tokens,
                                            outs[0].prompt_logprobs))
            j += sp.n
        return results
