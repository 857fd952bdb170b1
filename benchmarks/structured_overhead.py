"""Structured outputs' cost, measured side by side in one run:

- a decode step at batch B with half the rows held to a grammar that lasts the whole run (a
  400-character regex, so no row's grammar ends while timed), against the same batch unconstrained: steps interleaved (A, B, A, B, ...), medians, and the mask's own time per step
  from the timeline (`grammar mask` spans, category `mask`);
- compiling the schema: cold (a new compiler) and again (xgrammar's cache).

    python benchmarks/structured_overhead.py --model small --batch 16 --steps 40
"""

from __future__ import annotations

import argparse
import statistics
import time

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 8},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city"]}}, "required": ["name", "age"]}


def engine_steps(model_dir, batch: int, steps: int, constrained: bool):
    import torch

    from ouro.config import EngineConfig
    from ouro.engine.llm_engine import LLMEngine
    from ouro.engine.sampling import SamplingParams
    from ouro.models.loader import load_model
    from ouro.models.resolve import load_tokenizer
    e = LLMEngine(load_model(model_dir), load_tokenizer(model_dir),
                  EngineConfig(max_memory=512 << 20, page_size=16, max_num_seqs=batch), verbose=False)
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        structured = {"type": "regex", "regex": "[a-z ,.]{400}"} if constrained and i % 2 == 0 else None
        ids = torch.randint(300, 500, (32,), generator=g).tolist()
        e.add_request({"prompt_token_ids": ids}, SamplingParams(temperature=0.8, seed=i, max_tokens=steps + 8,
                                                                ignore_eos=True, structured=structured))
    while any(r.num_computed < len(r.prompt_ids) for r in e.requests.values()) or e.grammars:
        e.step()                       # prefill (and the grammars' compile) out of the timed steps
    return e


def main() -> None:
    from ouro.measure import spans
    from ouro.models.resolve import load_tokenizer, resolve_model
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=40)
    a = ap.parse_args()
    d = resolve_model(a.model)
    engines = {"unconstrained": engine_steps(d, a.batch, a.steps, False),
               "half constrained": engine_steps(d, a.batch, a.steps, True)}
    times = {k: [] for k in engines}
    mask_ms = []
    for _ in range(a.steps):
        for k, e in engines.items():
            spans.clear()
            spans.enable()
            t = time.perf_counter()
            e.step()
            times[k].append(time.perf_counter() - t)
            spans.disable()
            if k == "half constrained":
                mask_ms.append(sum(ev["dur_ms"] for ev in spans.events() if ev["cat"] == "mask"))
    live = {k: sum(1 for r in e.requests.values() if r.constraint is not None and not r.constraint.done)
            for k, e in engines.items()}
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"{a.model}, decode steps at batch {a.batch}, {a.steps} interleaved steps each, medians")
    print(f"  unconstrained            {med['unconstrained']:8.2f} ms/step")
    print(f"  half constrained         {med['half constrained']:8.2f} ms/step  ({live['half constrained']} rows "
          f"constrained to the end)  ratio {med['half constrained'] / med['unconstrained']:.3f}")
    print(f"  mask (timeline)          {statistics.median(mask_ms):8.3f} ms/step "
          f"({statistics.median(mask_ms) / med['half constrained']:.1%} of the step)")
    from ouro.config import ModelConfig
    from ouro.engine.structured import GrammarBook
    c = ModelConfig.from_hf(d)
    tok = load_tokenizer(d)
    t = time.perf_counter()
    book = GrammarBook(tok, c.vocab_size, c.eos_token_ids)
    built = time.perf_counter() - t
    t = time.perf_counter()
    book.compile({"type": "json_schema", "schema": SCHEMA})
    cold = time.perf_counter() - t
    t = time.perf_counter()
    book.compile({"type": "json_schema", "schema": SCHEMA})
    warm = time.perf_counter() - t
    print(f"  compile (the JSON schema above):  tokenizer info {built * 1e3:.1f} ms (once per process), schema cold {cold * 1e3:.2f} ms, "
          f"cached {warm * 1e3:.3f} ms; vocabulary {c.vocab_size:,}")


if __name__ == "__main__":
    main()
