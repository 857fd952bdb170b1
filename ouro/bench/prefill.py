"""Prefill of one prompt: ouro against transformers on the same checkpoint, interleaved."""

from __future__ import annotations

import statistics
import time

import torch

from ..measure.ab import verdict_from_times
from ..measure.spans import span
from ..measure.roofline import Roofline, count_flops
from ..measure.step_cost import prefill_cost


def bench_prefill(model_dir, input_len: int = 1024, repeats: int = 3, compare: bool = True, seed: int = 0,
                  progress: bool = True) -> dict:
    from tqdm import tqdm

    from ..engine.simple_runner import SimpleRunner
    from ..models.loader import load_model
    model = load_model(model_dir)
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (input_len,), generator=torch.Generator().manual_seed(seed))
    roof = Roofline.measure()
    def run_ouro():
        with span("prefill", cat="compute"):
            return SimpleRunner(model, 1, input_len).step([ids.tolist()])
    hf = None
    if compare:
        from transformers import Glm5NextForConditionalGeneration
        from transformers.utils import logging
        logging.set_verbosity_error()
        hf = Glm5NextForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()

    def run_hf():
        with torch.no_grad(), span("prefill (transformers)", cat="compute"):
            return hf(ids.view(1, -1), logits_to_keep=1).logits[0, -1]
    if hf is not None:  # the comparison only counts when both compute the same thing
        a, b = run_ouro()[0], run_hf()
        err = float((a - b).norm() / b.norm())
        if not err <= 1e-4:
            raise RuntimeError(f"ouro and transformers disagree (rel. RMS {err:.2e}); not timing a wrong result")
    cost = prefill_cost(model, input_len)   # what the prefill must do, not what ouro dispatches
    dispatched = count_flops(run_ouro)
    times = {"ouro": [], "transformers": []}
    run_ouro()  # warm-up
    if hf is not None:
        run_hf()
    for _ in tqdm(range(repeats), desc=f"prefill {input_len}", disable=not progress):
        for name, fn in (("ouro", run_ouro), ("transformers", run_hf)):  # interleaved
            if name == "transformers" and hf is None:
                continue
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    result = {
        "input_len": input_len, "repeats": repeats,
        "ouro_s": statistics.median(times["ouro"]),
        "flops": cost.flops, "bytes": cost.bytes, "dispatched_flops": dispatched,
        "matmul_flops_per_s": roof.flops_per_s, "copy_bytes_per_s": roof.bytes_per_s,
        "floor_s": roof.floor_s(cost.flops, cost.bytes),
    }
    if hf is not None:
        result["transformers_s"] = statistics.median(times["transformers"])
        result["ratio"] = result["transformers_s"] / result["ouro_s"]  # > 1: ouro is faster
        # the A/B verdict of ouro (B) against transformers (A) over the interleaved repeats
        result["verdict"] = verdict_from_times(times["transformers"], times["ouro"], "transformers", "ouro").to_dict()
    result["ouro_over_floor"] = result["ouro_s"] / result["floor_s"]
    return result


def format_prefill(r: dict) -> str:
    lines = [f"prefill of {r['input_len']} tokens, median of {r['repeats']} (interleaved)",
             f"  ouro          {r['ouro_s']:.3f} s  ({r['input_len'] / r['ouro_s']:.0f} tok/s)"]
    if "transformers_s" in r:
        lines.append(f"  transformers  {r['transformers_s']:.3f} s  ({r['input_len'] / r['transformers_s']:.0f} tok/s)")
        lines.append(f"  speed-up      {r['ratio']:.2f}x (transformers time / ouro time)")
        if "verdict" in r:
            v = r["verdict"]
            lines.append(f"  A/B verdict   ouro is {v['verdict']} (time ratio {v['ratio']:.3f}, interval "
                         f"{v['low']:.3f}..{v['high']:.3f}, {v['repeats']} interleaved pairs)")
    lines.append(f"  floor         {r['floor_s']:.3f} s  = max({r['flops'] / 1e9:.1f} GFLOP at "
                 f"{r['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s, {r['bytes'] / 2**20:.0f} MiB at "
                 f"{r['copy_bytes_per_s'] / 1e9:.1f} GB/s measured); ouro is {r['ouro_over_floor']:.1f}x the floor "
                 f"(it dispatches {r['dispatched_flops'] / 1e9:.1f} GFLOP)")
    return "\n".join(lines)


def bench_prefill_breakdown(model_dir, num_prompts: int, input_len: int, repeats: int = 3, device: str = "cpu",
                            dtype: str = "auto", quantization: str | None = None, engine_fields: dict | None = None,
                            seed: int = 0) -> dict:
    """`ouro bench prefill --breakdown`: the engine's prefill of `num_prompts` x `input_len` new
    prompts (first token only), `repeats` plain runs interleaved with as many hooked ones, by part
    against each part's floor (`ouro.measure.step_breakdown.prefill_breakdown`)."""
    from ..config import EngineConfig
    from ..engine.sampling import SamplingParams
    from ..measure.step_breakdown import prefill_breakdown
    from ..models.loader import load_model
    from .offline import low_precision_rate, make_engine, make_prompts
    torch_dtype = EngineConfig(device=device, dtype=dtype).torch_dtype()
    model = load_model(model_dir, device=device, dtype=torch_dtype)
    engine = make_engine(model, None, input_len, 1, num_prompts, device=device, quantization=quantization,
                         model_dir=model_dir, engine_fields=engine_fields)
    roof = Roofline.measure(device, model.embed_tokens.weight.dtype)
    low_precision_rate(engine.model, roof)
    V = model.config.vocab_size
    # the first set warms up (kernel builds, allocator); then plain and hooked sets alternate
    sets = [make_prompts(num_prompts, input_len, V, seed + i) for i in range(2 * repeats + 1)]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for p in sets[0]:
        engine.add_request({"prompt_token_ids": p}, params)
    while engine.has_unfinished():
        engine.step()
    r = prefill_breakdown(engine, sets[1:], roof, params)
    r.update({"threads": torch.get_num_threads(), "dtype": str(torch_dtype).replace("torch.", ""),
              "max_num_batched_tokens": engine.config.max_num_batched_tokens,
              "quantization": engine.config.quantization})
    engine.close()
    return r
