"""A/B of `--compile` on a decode step: the same engine, steps alternating between the eager and
the compiled mHC functions (interleaved, medians), and aten ops dispatched per step each way.

    python benchmarks/compile_ab.py --model small --batch 16 --prompt-len 128 --steps 24
"""

import argparse
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ouro.config import EngineConfig
from ouro.engine.compile import compile_model
from ouro.engine.llm_engine import LLMEngine
from ouro.engine.sampling import SamplingParams
from ouro.layers.mhc import HyperConnection
from ouro.lab.ab import verdict_from_times
from ouro.models.loader import load_model
from ouro.models.resolve import load_tokenizer, resolve_model


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
    a = ap.parse_args()
    d = resolve_model(a.model)
    model = load_model(d, dtype=torch.float32)
    eng = LLMEngine(model, load_tokenizer(d), EngineConfig(max_num_seqs=a.batch, max_num_batched_tokens=4096,
                    max_model_len=a.prompt_len + 2 * a.steps + 8), verbose=False)
    g = torch.Generator().manual_seed(0)
    for _ in range(a.batch):
        eng.add_request({"prompt_token_ids": torch.randint(0, model.config.vocab_size, (a.prompt_len,),
                                                           generator=g).tolist()},
                        SamplingParams(temperature=0, max_tokens=2 * a.steps + 4, ignore_eos=True))
    eng.step()
    t = time.perf_counter()
    done = compile_model(model)
    print(f"compile: {done['compiled']} functions, {time.perf_counter() - t:.1f} s")
    hcs = [m for m in model.modules() if isinstance(m, HyperConnection)]
    fn = hcs[0].pre_fn

    def use(compiled):
        for m in hcs:
            m.pre_fn = fn if compiled else None
    ops = {}
    for compiled in (False, True):
        use(compiled)
        eng.step()
        with CountOps() as c:
            eng.step()
        ops[compiled] = c.n
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
    print(f"aten ops per decode step: eager {ops[False]}, compiled {ops[True]}")


if __name__ == "__main__":
    main()
