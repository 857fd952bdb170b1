"""Greedy and sampled continuations of three prompts from a model (default: the built-in tiny-py),
through ouro's engine. python benchmarks/samples.py [--model M] [--max-tokens N]"""

import argparse

from ouro import LLM, SamplingParams

PROMPTS = ["import os\nimport sys\n\n\ndef main(", "class Queue:\n    \"\"\"", "    for line in lines:\n        if "]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny-py")
    p.add_argument("--max-tokens", type=int, default=80)
    args = p.parse_args()
    llm = LLM(args.model, dtype="float32", max_memory=128 << 20, page_size=16)
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_tokens=args.max_tokens)
    for prompt in PROMPTS:
        for name, params in (("greedy", greedy), ("sampled t=0.8 top_p=0.95 seed=0", sampled)):
            out = llm.generate([prompt], params)[0]
            print(f"--- {name}, prompt {prompt!r}\n{prompt}{out.text}\n")


if __name__ == "__main__":
    main()
