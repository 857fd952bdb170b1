"""Offline throughput: many prompts through ouro's engine and (optionally) through transformers'
`generate` on the same checkpoint in the same process, plus the decode step's roofline floor."""

from __future__ import annotations

import statistics
import time

import torch

from .roofline import Roofline, count_flops


def _prompts(n, length, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


def run_ouro(model, tokenizer, prompts, output_len, concurrency, progress, device="cpu"):
    from tqdm import tqdm

    from ..config import EngineConfig
    from ..engine.llm_engine import LLMEngine
    from ..engine.sampling import SamplingParams
    length = len(prompts[0]) + output_len
    cfg = EngineConfig(device=device, max_num_seqs=concurrency, max_num_batched_tokens=max(2048, len(prompts[0])),
                       page_size=64, max_model_len=length)
    engine = LLMEngine(model, tokenizer, cfg, verbose=False)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for p in prompts:
        engine.add_request({"prompt_token_ids": p}, params)
    decode_steps, bar, outputs = [], tqdm(total=len(prompts), desc="ouro", disable=not progress), {}
    start = time.perf_counter()
    while engine.has_unfinished():
        pure_decode = all(r.num_computed == r.num_tokens - 1 for r in engine.scheduler.running) and \
            len(engine.scheduler.running) == concurrency and not engine.scheduler.waiting
        t = time.perf_counter()
        outs = engine.step()
        if pure_decode:
            decode_steps.append(time.perf_counter() - t)
        for o in outs:
            if o.finished:
                outputs[o.request_id] = o.token_ids
                bar.update(1)
    elapsed = time.perf_counter() - start
    bar.close()
    return elapsed, decode_steps, engine, [outputs[k] for k in sorted(outputs, key=lambda s: int(s.split("-")[1]))]


def run_transformers(model_dir, prompts, output_len, concurrency, progress, device="cpu", dtype=torch.float32):
    from tqdm import tqdm
    from transformers import Glm5NextForConditionalGeneration
    from transformers.utils import logging
    logging.set_verbosity_error()
    hf = Glm5NextForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    outs, start = [], time.perf_counter()
    for i in tqdm(range(0, len(prompts), concurrency), desc="transformers", disable=not progress):
        batch = torch.tensor(prompts[i:i + concurrency], device=device)
        with torch.no_grad():
            gen = hf.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=output_len,
                              min_new_tokens=output_len, do_sample=False, eos_token_id=None, pad_token_id=0)
        outs += gen[:, batch.shape[1]:].tolist()
    return time.perf_counter() - start, outs


def decode_floor(model, roof: Roofline, context: int, batch: int) -> dict:
    """Bytes a batch-`batch` decode step must move (weights once, each sequence's cache and KDA
    state) and FLOPs it must do, over the measured bandwidth and matmul rate."""
    from ..layers.context import ModelCache
    cfg = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    weight_bytes -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size() * (1 - batch / cfg.vocab_size)
    cache_bytes = batch * (context * ModelCache.bytes_per_token(cfg) + 2 * ModelCache.bytes_per_slot(cfg))
    flops = 2 * batch * (sum(p.numel() for p in model.parameters()) - cfg.vocab_size * cfg.hidden_size)
    return {"weight_bytes": weight_bytes, "cache_bytes": cache_bytes, "flops": flops,
            "floor_s": roof.floor_s(flops, weight_bytes + cache_bytes)}


def bench_offline(model_dir, num_prompts=64, input_len=256, output_len=64, concurrency=32, compare=False,
                  seed=0, progress=True, device="cpu", dtype="auto") -> dict:
    from ..config import EngineConfig
    from ..models.resolve import load_tokenizer
    from ..models.loader import load_model
    model = load_model(model_dir, dtype=EngineConfig(device=device, dtype=dtype).torch_dtype(), device=device)
    roof = Roofline.measure(device, model.embed_tokens.weight.dtype)
    prompts = _prompts(num_prompts, input_len, model.config.vocab_size, seed)
    elapsed, steps, engine, outs = run_ouro(model, load_tokenizer(model_dir), prompts, output_len, concurrency,
                                            progress, device)
    n_in, n_out = num_prompts * input_len, num_prompts * output_len
    r = {"num_prompts": num_prompts, "input_len": input_len, "output_len": output_len, "concurrency": concurrency,
         "ouro": {"seconds": elapsed, "input_tok_s": n_in / elapsed, "output_tok_s": n_out / elapsed,
                  "decode_step_s": statistics.median(steps) if steps else None, "decode_steps_timed": len(steps)},
         "matmul_flops_per_s": roof.flops_per_s, "copy_bytes_per_s": roof.bytes_per_s}
    r["decode_floor"] = decode_floor(model, roof, input_len + output_len // 2, concurrency)
    if steps:
        r["decode_step_over_floor"] = r["ouro"]["decode_step_s"] / r["decode_floor"]["floor_s"]
    # prefill of one prompt against its FLOP floor
    from ..engine.sampling import SamplingParams

    def one():
        engine.add_request({"prompt_token_ids": prompts[0]}, SamplingParams(temperature=0, max_tokens=1))
        _drain(engine)
    flops = count_flops(one)
    t = statistics.median([_timed(one) for _ in range(3)])
    r["prefill"] = {"tokens": input_len, "seconds": t, "flops": flops, "floor_s": flops / roof.flops_per_s,
                    "over_floor": t / (flops / roof.flops_per_s)}
    if compare:
        t_hf, hf_outs = run_transformers(model_dir, prompts, output_len, concurrency, progress, device,
                                         model.embed_tokens.weight.dtype)
        r["transformers"] = {"seconds": t_hf, "input_tok_s": n_in / t_hf, "output_tok_s": n_out / t_hf}
        r["ratio"] = r["ouro"]["output_tok_s"] / r["transformers"]["output_tok_s"]
        r["same_tokens"] = sum(a == b for a, b in zip(outs, hf_outs)) / len(outs)
    return r


def _drain(engine):
    while engine.has_unfinished():
        engine.step()


def _timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def format_offline(r: dict) -> str:
    o = r["ouro"]
    lines = [f"offline: {r['num_prompts']} prompts x ({r['input_len']} in / {r['output_len']} out), "
             f"concurrency {r['concurrency']}",
             f"  ouro          {o['seconds']:8.2f} s  input {o['input_tok_s']:8.1f} tok/s  output {o['output_tok_s']:7.1f} tok/s"]
    if "transformers" in r:
        t = r["transformers"]
        lines.append(f"  transformers  {t['seconds']:8.2f} s  input {t['input_tok_s']:8.1f} tok/s  "
                     f"output {t['output_tok_s']:7.1f} tok/s")
        lines.append(f"  ratio (output tok/s, ouro / transformers): {r['ratio']:.2f}x; "
                     f"identical greedy outputs: {100 * r['same_tokens']:.0f}%")
    f = r["decode_floor"]
    if o["decode_step_s"]:
        lines.append(f"  decode step (batch {r['concurrency']}): {1e3 * o['decode_step_s']:.1f} ms, floor "
                     f"{1e3 * f['floor_s']:.1f} ms ({(f['weight_bytes'] + f['cache_bytes']) / 2**20:.0f} MiB at "
                     f"{r['copy_bytes_per_s'] / 1e9:.1f} GB/s, {f['flops'] / 1e9:.1f} GFLOP at "
                     f"{r['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s): {r['decode_step_over_floor']:.1f}x the floor")
    p = r["prefill"]
    lines.append(f"  prefill of {p['tokens']} tokens: {1e3 * p['seconds']:.0f} ms, FLOP floor {1e3 * p['floor_s']:.0f} ms "
                 f"({p['flops'] / 1e9:.1f} GFLOP): {p['over_floor']:.1f}x the floor")
    return "\n".join(lines)
