"""Offline API, vLLM style: `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import EngineConfig
from .llm_engine import LLMEngine
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


class LLM:
    def __init__(self, model: str, device: str = "cpu", dtype: str = "auto", max_memory: int | None = None,
                 memory_fraction: float = 0.5,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048, page_size: int = 64,
                 enable_prefix_caching: bool = False, prefix_checkpoint_interval: int = 1, seed: int = 0,
                 verbose: bool = False):
        from ..models.resolve import load_tokenizer
        from ..models.loader import load_model
        from ..models.resolve import resolve_model
        cfg = EngineConfig(device=device, dtype=dtype, max_memory=max_memory, memory_fraction=memory_fraction,
                           max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens, page_size=page_size, seed=seed)
        directory = resolve_model(model, progress=verbose)
        weights = load_model(directory, dtype=cfg.torch_dtype(), device=device, kda_chunk_size=cfg.kda_chunk_size)
        self.engine = LLMEngine(weights, load_tokenizer(directory), cfg, enable_prefix_caching,
                                checkpoint_interval=prefix_checkpoint_interval, verbose=verbose)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[GenerationResult]:
        single = isinstance(prompts, (str, dict))
        prompts = [prompts] if single else list(prompts)
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        order = []
        for i, (p, sp) in enumerate(zip(prompts, plist)):
            ids = [self.engine.add_request(p, sp, f"gen-{id(self)}-{i}-{k}") for k in range(sp.n)]
            order.append(ids)
        finished = {}
        from tqdm import tqdm
        bar = tqdm(total=sum(len(x) for x in order), desc="generate", disable=not use_tqdm)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
                    bar.update(1)
        bar.close()
        results = []
        for i, ids in enumerate(order):
            outs = [finished[r] for r in ids]
            comps = [CompletionOutput(k, o.text, o.token_ids, o.finish_reason, o.stop_reason, o.logprobs,
                                      o.top_logprobs) for k, o in enumerate(outs)]
            results.append(GenerationResult(ids[0], outs[0].prompt_token_ids, comps, outs[0].cached_tokens))
        return results
