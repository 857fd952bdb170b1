"""Offline throughput: many prompts through ouro's engine and (optionally) through transformers'
`generate` on the same checkpoint in the same process, plus the roofline floors.

The prompts go in waves of `concurrency` (equal lengths, so continuous batching would form the
same waves), ouro's wave then transformers' on the same prompts: the two systems see the same
machine load, which on a shared machine drifts over minutes."""

from __future__ import annotations

import os
import statistics
import time

import torch

from ..measure.ab import verdict_from_times
from ..measure.spans import span
from .offline_report import format_offline  # noqa: F401  (the CLI imports it from here)
from ..measure.roofline import Roofline, count_flops
from ..measure.step_cost import decode_cost, prefill_cost


def make_prompts(n, length, vocab, seed):
    """The benchmark's random prompts (also rebuilt by benchmarks/router_near_tie.py)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


def make_engine(model, tokenizer, input_len, output_len, concurrency, device="cpu", compile=False, compile_max_bs=32,
                quantization=None, speculative=None, model_dir=None, deterministic=False, engine_fields=None):
    """engine_fields: EngineConfig fields from a config file (`--config`), over the flags' values."""
    from ..config import EngineConfig
    from ..engine.llm_engine import LLMEngine
    fields = dict(device=device, max_num_seqs=concurrency, max_num_batched_tokens=max(2048, input_len),
                  page_size=64, max_model_len=input_len + output_len, compile=compile,
                  torch_compile_max_bs=compile_max_bs, quantization=quantization,
                  deterministic_inference=deterministic, **(speculative or {}))
    cfg = EngineConfig(**{**fields, **(engine_fields or {})})
    return LLMEngine(model, tokenizer, cfg, verbose=compile, model_dir=model_dir)


def run_ouro(engine, prompts, output_len):
    """Returns (seconds, step log, outputs in prompt order). The step log has each step's time, how
    many sequences it advanced, whether each advanced by one token (a decode-only step) and their
    mean length after it."""
    from ..engine.sampling import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    ids = [engine.add_request({"prompt_token_ids": p}, params) for p in prompts]
    reqs = [engine.requests[i] for i in ids]   # kept: finished requests may leave engine.requests
    log, outputs = [], {}
    start = time.perf_counter()
    while engine.has_unfinished():
        before = [r.num_computed for r in reqs]
        t = time.perf_counter()
        outs = engine.step()
        spent = time.perf_counter() - t
        moved = [(r, r.num_computed - b) for r, b in zip(reqs, before) if r.num_computed != b]
        log.append({"s": spent, "batch": len(moved), "decode": bool(moved) and all(d == 1 for _, d in moved),
                    "context": statistics.mean(r.num_computed for r, _ in moved) if moved else 0})
        outputs.update({o.request_id: o.token_ids for o in outs if o.finished})
    return time.perf_counter() - start, log, [outputs[i] for i in ids]


def load_transformers(model_dir, device="cpu", dtype=torch.float32):
    from transformers import Glm5NextForConditionalGeneration
    from transformers.utils import logging
    logging.set_verbosity_error()
    return Glm5NextForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def run_transformers(hf, prompts, output_len, device="cpu"):
    """One batched greedy `generate` over equal-length prompts; returns (seconds, outputs)."""
    batch = torch.tensor(prompts, device=device)
    start = time.perf_counter()
    with torch.no_grad():
        gen = hf.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=output_len,
                          min_new_tokens=output_len, do_sample=False, eos_token_id=None, pad_token_id=0)
    return time.perf_counter() - start, gen[:, batch.shape[1]:].tolist()


def decode_floor(model, roof: Roofline, context: int, batch: int) -> dict:
    """The floor of a decode step of `batch` sequences at `context` tokens: `decode_cost` (what
    the step must compute and move) over the measured matmul rate and copy bandwidth."""
    cost = decode_cost(model, context, batch)
    low = cost.parts["low_precision_flops"]
    return {"context": context, "batch": batch, "weight_bytes": cost.weight_bytes, "cache_bytes": cost.cache_bytes,
            "activation_bytes": cost.activation_bytes, "flops": cost.flops, "low_precision_flops": low, "floor_s": roof.floor_s(cost.flops, cost.bytes, low),
            "parts": cost.parts}


def low_precision_rate(model, roof: Roofline) -> None:
    """A quantised model's products run at their own rate: measured once into `roof`."""
    from ..quant.w8a8 import product_rate
    kinds = {b.dtype for _, b in model.named_buffers()}
    for method, dtype in (("w8a8", torch.int8), ("fp8", torch.float8_e4m3fn)):
        if dtype in kinds and roof.low_flops_per_s is None:
            roof.low_flops_per_s = product_rate(method)


def bench_offline(model_dir, num_prompts=64, input_len=256, output_len=64, concurrency=32, compare=False,
                  seed=0, progress=True, device="cpu", dtype="auto", compile=False, compile_max_bs=32,
                  quantization=None, speculative=None, deterministic=False, engine_fields=None) -> dict:
    """engine_fields: EngineConfig fields of a config file (`ouro bench offline --config tuned.toml`)."""
    from tqdm import tqdm

    from ..config import EngineConfig
    from ..models.loader import load_model
    from ..models.resolve import load_tokenizer
    load_start = os.getloadavg()[0]   # other processes on the machine skew every timing below
    engine_fields = engine_fields or {}
    dtype = engine_fields.get("dtype", dtype)
    model = load_model(model_dir, dtype=EngineConfig(device=device, dtype=dtype).torch_dtype(), device=device)
    roof = Roofline.measure(device, model.embed_tokens.weight.dtype)
    prompts = make_prompts(num_prompts, input_len, model.config.vocab_size, seed)
    engine = make_engine(model, load_tokenizer(model_dir), input_len, output_len, concurrency, device, compile,
                         compile_max_bs, quantization, speculative, model_dir, deterministic, engine_fields)
    hf = load_transformers(model_dir, device, model.embed_tokens.weight.dtype) if compare else None
    waves, log, outs, hf_outs = [], [], [], []
    for i in tqdm(range(0, num_prompts, concurrency), desc="waves (ouro, transformers)", disable=not progress):
        wave = prompts[i:i + concurrency]
        with span("ouro wave", cat="bench"):
            t, steps, o = run_ouro(engine, wave, output_len)
        waves.append({"prompts": len(wave), "ouro_s": t})
        log, outs = log + steps, outs + o
        if hf is not None:
            with span("transformers wave", cat="bench"):
                waves[-1]["transformers_s"], o = run_transformers(hf, wave, output_len, device)
            hf_outs += o
    low_precision_rate(model, roof)
    r = {"seed": seed, "num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
         "concurrency": concurrency, "device": device, "compile": engine.config.compile,
         "quantization": engine.config.quantization, "engine_fields": engine_fields or None,
         "kept_unquantised": (getattr(engine, "quantized", None) or {}).get("kept"),
         "speculative": speculative or None,
         "dtype": str(model.embed_tokens.weight.dtype).replace("torch.", ""), "waves": waves,
         "ouro": _throughput(sum(w["ouro_s"] for w in waves), num_prompts * input_len, outs),
         "matmul_flops_per_s": roof.flops_per_s, "copy_bytes_per_s": roof.bytes_per_s,
         "low_precision_ops_per_s": roof.low_flops_per_s}
    decode = [s for s in log if s["decode"] and s["batch"] == concurrency]   # the steps timed
    r["ouro"].update({"decode_step_s": statistics.median(s["s"] for s in decode) if decode else None,
                      "decode_steps_timed": len(decode),
                      "steps": {"with_prefill": sum(not s["decode"] for s in log),
                                "with_prefill_s": sum(s["s"] for s in log if not s["decode"]),
                                "decode_only": sum(s["decode"] for s in log),
                                "decode_only_s": sum(s["s"] for s in log if s["decode"])}})
    # the floor at the timed steps' mean sequence length (tokens the new token sees)
    context = round(statistics.mean(s["context"] for s in decode)) if decode else input_len + output_len // 2
    r["decode_floor"] = decode_floor(model, roof, context, concurrency)
    if decode:
        r["decode_step_over_floor"] = r["ouro"]["decode_step_s"] / r["decode_floor"]["floor_s"]
    if engine.speculator is not None:       # acceptance over the measured waves
        r["speculative_stats"] = engine.speculator.stats.summary()
    r["prefill"] = _prefill(engine, model, roof, prompts[0])
    if hf is not None:
        r["transformers"] = _throughput(sum(w["transformers_s"] for w in waves), num_prompts * input_len, hf_outs)
        r["ratio"] = r["ouro"]["output_tok_s"] / r["transformers"]["output_tok_s"]
        # the A/B verdict of ouro (B) against transformers (A) over the alternating waves (same prompts)
        r["verdict"] = verdict_from_times([w["transformers_s"] for w in waves], [w["ouro_s"] for w in waves],
                                          "transformers", "ouro").to_dict()
        r["same_tokens"] = sum(a == b for a, b in zip(outs, hf_outs)) / len(outs)
        # the outputs that part, and where (benchmarks/router_near_tie.py --offline-json looks into them)
        r["differing"] = [{"prompt": i, "position": next((j for j, (x, y) in enumerate(zip(a, b)) if x != y),
                                                         min(len(a), len(b))),
                           "ouro": a, "transformers": b} for i, (a, b) in enumerate(zip(outs, hf_outs)) if a != b]
    if dtype == "auto":                  # what the measurement behind `auto` saw
        from ..machine.dtype_pick import cached_entry
        r["dtype_auto"] = cached_entry(device)
    r["load_average"] = [load_start, os.getloadavg()[0]]
    return r


def _throughput(seconds, input_tokens, outputs):
    n = sum(len(o) for o in outputs)   # tokens actually produced
    return {"seconds": seconds, "output_tokens": n, "input_tok_s": input_tokens / seconds, "output_tok_s": n / seconds}


def _prefill(engine, model, roof, prompt):
    """Prefill of one prompt (one chunk) and its first token, median of 3, against its floor."""
    from ..engine.sampling import SamplingParams

    def one():
        engine.add_request({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1))
        while engine.has_unfinished():
            engine.step()

    def timed():
        t = time.perf_counter()
        one()
        return time.perf_counter() - t
    cost = prefill_cost(model, len(prompt))
    t = statistics.median([timed() for _ in range(3)])
    floor = roof.floor_s(cost.flops, cost.bytes, cost.parts["low_precision_flops"])
    return {"tokens": len(prompt), "seconds": t, "flops": cost.flops, "bytes": cost.bytes, "floor_s": floor,
            "low_precision_flops": cost.parts["low_precision_flops"],
            "over_floor": t / floor, "dispatched_flops": count_flops(one)}
