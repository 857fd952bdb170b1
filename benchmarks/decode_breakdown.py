"""Where a decode step's time goes: module forward hooks around each part of the model, on the
engine's own decode steps (same engine settings as `ouro bench offline`), each part against its
own roofline floor (`ouro.measure.step_breakdown`).

    python benchmarks/decode_breakdown.py --model small --batch 32 --input-len 256 --steps 8
    python benchmarks/decode_breakdown.py --model small --batch 16 --config tuned.toml

Plain and hooked steps are interleaved; each row is a median over the hooked steps of the time
spent in that part and nowhere else (rows add up to the hooked step). The plain step's median is
printed against the total, so the hooks' own cost shows; with a compiled configuration the plain
step is the compiled one and the hooked step the eager forward.

`--compiled` (a compiled configuration): the compiled step itself, by the ops it calls, under
`torch.profiler` (`ouro.measure.op_breakdown`): each element-wise op group against the floor of its
own work, as the step a user runs.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from ouro.bench.offline import low_precision_rate, make_prompts  # noqa: E402
from ouro.config import EngineConfig  # noqa: E402
from ouro.config.file import load_config_file  # noqa: E402
from ouro.engine.llm_engine import LLMEngine  # noqa: E402
from ouro.engine.sampling import SamplingParams  # noqa: E402
from ouro.measure.op_breakdown import compiled_breakdown, format_compiled  # noqa: E402
from ouro.measure.roofline import Roofline  # noqa: E402
from ouro.measure.step_breakdown import decode_breakdown, format_breakdown  # noqa: E402
from ouro.models.loader import load_model  # noqa: E402
from ouro.models.resolve import resolve_model  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8, help="hooked steps (as many plain ones interleaved)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--config", default=None, help="engine fields from a config file (ouro tune's output)")
    ap.add_argument("--compiled", action="store_true", help="the compiled step by op group (needs compile = true)")
    a = ap.parse_args()
    fields = load_config_file(a.config) if a.config else {}
    cfg = EngineConfig(**{"device": a.device, "max_num_seqs": a.batch, "max_num_batched_tokens": max(2048, a.input_len),
                          "page_size": 64, "max_model_len": a.input_len + 2 * a.steps + 8, **fields,
                          **({"torch_compile_max_bs": a.batch} if fields.get("compile") else {})})
    d = resolve_model(a.model, progress=False)
    model = load_model(d, device=a.device, dtype=cfg.torch_dtype())
    engine = LLMEngine(model, None, cfg, verbose=False, model_dir=d)
    roof = Roofline.measure(a.device, model.embed_tokens.weight.dtype)
    low_precision_rate(engine.model, roof)
    prompts = make_prompts(a.batch, a.input_len, model.config.vocab_size, 0)
    params = SamplingParams(temperature=0, max_tokens=2 * a.steps + 8, ignore_eos=True)
    b = (compiled_breakdown if a.compiled else decode_breakdown)(engine, prompts, a.steps, roof, params)
    print(f"{a.model}, {a.device}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}, "
          f"fields {fields or 'defaults'}; medians of {a.steps} steps")
    print(format_compiled(b) if a.compiled else format_breakdown(b))
    engine.close()


if __name__ == "__main__":
    main()
