"""A/B of `--compile` on decode steps: one engine, steps alternating between the eager forward and
the compiled decode graph (interleaved, medians, `ouro.measure.ab` verdict), the aten ops an eager
step dispatches, and the start-up time with the compile.

    python benchmarks/compile_ab.py --model small --batch 16 --prompt-len 128 --steps 24
"""

import argparse
import os
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from ouro.config import EngineConfig  # noqa: E402
from ouro.engine.llm_engine import LLMEngine  # noqa: E402
from ouro.engine.sampling import SamplingParams  # noqa: E402
from ouro.measure.ab import verdict_from_times  # noqa: E402
from ouro.models.loader import load_model  # noqa: E402
from ouro.models.resolve import load_tokenizer, resolve_model  # noqa: E402


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--dtype", default="auto")
    a = ap.parse_args()
    d = resolve_model(a.model)
    cfg = EngineConfig(max_num_seqs=a.batch, max_num_batched_tokens=4096, dtype=a.dtype,
                       max_model_len=a.prompt_len + 2 * a.steps + 8, compile=True, torch_compile_max_bs=a.batch)
    model = load_model(d, dtype=cfg.torch_dtype())
    t = time.perf_counter()
    eng = LLMEngine(model, load_tokenizer(d), cfg, verbose=True)
    print(f"engine with compiled decode: {time.perf_counter() - t:.1f} s to start ({model.embed_tokens.weight.dtype})")
    g = torch.Generator().manual_seed(0)
    for _ in range(a.batch):
        eng.add_request({"prompt_token_ids": torch.randint(0, model.config.vocab_size, (a.prompt_len,),
                                                           generator=g).tolist()},
                        SamplingParams(temperature=0, max_tokens=2 * a.steps + 4, ignore_eos=True))
    eng.step()
    runner, graph = eng.runner, eng.runner.graph

    def use(compiled):
        runner.graph = graph if compiled else None
    use(False)
    eng.step()
    with CountOps() as c:   # (a dispatch mode cannot run through a compiled graph: eager only)
        eng.step()
    use(True)
    eng.step()
    times = {False: [], True: []}
    for i in range(a.steps):
        compiled = i % 2 == 1
        use(compiled)
        t = time.perf_counter()
        eng.step()
        times[compiled].append(time.perf_counter() - t)
    v = verdict_from_times(times[False], times[True], "eager", "compiled")
    print(f"decode step, batch {a.batch}: eager {1e3 * statistics.median(times[False]):.1f} ms, "
          f"compiled {1e3 * statistics.median(times[True]):.1f} ms; compiled is {v.verdict} "
          f"(ratio {v.ratio:.3f}, interval {v.low:.3f}..{v.high:.3f}, {v.repeats} steps each)")
    print(f"aten ops per eager decode step: {c.n}; the compiled step is one graph ({graph.runs} graph runs)")


if __name__ == "__main__":
    main()
