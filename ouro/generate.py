"""`ouro generate`: continue one prompt through the engine, streaming text as it comes."""

from __future__ import annotations

import sys

from .config import CheckpointError, split_patterns


def spec_config(args) -> dict | None:
    from .config import speculative_args
    # EngineConfig's field names -> speculative_config's keys (canary options included)
    rename = {"speculative_algorithm": "method", "speculative_num_steps": "num_speculative_tokens"}
    return {rename.get(k, k.removeprefix("speculative_")): v for k, v in speculative_args(args).items()} or None


def generate_cli(args) -> int:
    from .config import tp_args
    from .engine.llm import LLM
    from .engine.sampling import SamplingParams
    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_memory=args.max_memory,
              memory_fraction=args.mem_fraction_static, verbose=True,
              quantization=getattr(args, "quantization", None), quantization_ignore=split_patterns(getattr(args, "quantization_ignore", None)),
              kv_cache_dtype=args.kv_cache_dtype, kv_cache_layer_dtype=args.kv_cache_layer_dtype,
              speculative_config=spec_config(args),
              enable_deterministic_inference=bool(getattr(args, "enable_deterministic_inference", False)),
              tensor_parallel_size=tp_args(args)["tensor_parallel_size"], enable_expert_parallel=tp_args(args)["expert_parallel"])
    engine = llm.engine
    if args.prompt_token_ids is not None:
        try:
            prompt = {"prompt_token_ids": [int(x) for x in args.prompt_token_ids.split(",")]}
        except ValueError:
            raise ValueError(f"--prompt-token-ids takes comma-separated integers, got {args.prompt_token_ids!r}") from None
    elif engine.tokenizer is None:
        raise CheckpointError("the checkpoint has no tokenizer.json: pass --prompt-token-ids instead of --prompt")
    else:
        prompt = args.prompt
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                            max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    engine.add_request(prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            text = out.new_text if engine.tokenizer is not None else "".join(f"{t} " for t in out.new_token_ids)
            sys.stdout.write(text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0
