"""MTP speculative decoding on `tiny-py` against no speculation, same run, interleaved rounds,
medians: output tokens/s at batch 1, 4 and 16 for K = 1, 2, 3 (KDA state replay) and K = best
with per-step states; greedy outputs checked equal to the plain engine's; acceptance length on
held-out code; where a speculative step's time goes (draft, verify forward, replay) from the
engine's spans; KDA record bytes per request, replay against per-step states.

Prompts: the first 96 tokens of held-out standard-library files (the eval corpus's split), each
continued for 48 tokens.

    python benchmarks/spec_speed.py [--rounds 3] [--batches 1,4,16] [--ks 1,2,3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ouro.engine.llm import LLM  # noqa: E402
from ouro.engine.sampling import SamplingParams  # noqa: E402
from ouro.eval.corpus import held_out_prefixes  # noqa: E402
from ouro.measure import spans  # noqa: E402

PROMPT_LEN, OUTPUT_LEN = 96, 48


def held_out_prompts(tokenizer, n: int) -> list[dict]:
    return [{"prompt_token_ids": ids} for ids in held_out_prefixes(tokenizer, n, PROMPT_LEN)]


def run(llm, prompts):
    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    return time.perf_counter() - t, outs


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--ks", default="1,2,3")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    kw = dict(max_memory=256 << 20, page_size=16, max_num_seqs=max(batches))
    engines = {"off": LLM("tiny-py", **kw)}
    for k in ks:
        engines[f"K={k}"] = LLM("tiny-py", speculative_config={"num_speculative_tokens": k}, **kw)
    engines[f"K={max(ks)} per_step"] = LLM("tiny-py", speculative_config={"num_speculative_tokens": max(ks),
                                                                           "kda_state": "per_step"}, **kw)
    tok = engines["off"].engine.tokenizer
    print(f"tiny-py, {PROMPT_LEN}-token held-out prompts, {OUTPUT_LEN} output tokens, greedy; rounds {args.rounds}\n")
    print("| batch | variant | output tok/s | speed-up vs off | accept length | per-position acceptance | same tokens |")
    print("|---|---|---|---|---|---|---|")
    for batch in batches:
        prompts = held_out_prompts(tok, batch)
        times = {name: [] for name in engines}
        outs = {}
        for name, llm in engines.items():
            run(llm, prompts[:1])                                 # warm-up
            llm.engine.speculator and setattr(llm.engine.speculator, "stats", type(llm.engine.speculator.stats)())
        for r in range(args.rounds):
            order = list(engines) if r % 2 == 0 else list(reversed(engines))
            for name in order:
                t, o = run(engines[name], prompts)
                times[name].append(t)
                outs[name] = o
        base = statistics.median(times["off"])
        n_out = batch * OUTPUT_LEN
        for name, llm in engines.items():
            med = statistics.median(times[name])
            st = llm.engine.stats()
            acc = f"{st['spec_accept_length']:.2f}" if "spec_accept_length" in st else "-"
            per = ", ".join(f"{100 * a:.0f}%" for a in st.get("spec_accept_rate_per_position", [])) or "-"
            print(f"| {batch} | {name} | {n_out / med:.1f} | {base / med:.2f}x | {acc} | {per} | "
                  f"{'yes' if outs[name] == outs['off'] else 'NO'} |")
    # where a speculative step's time goes, and the KDA records' bytes
    print("\n| variant (batch 4) | forward s | draft s | replay s | KDA record bytes per request |")
    print("|---|---|---|---|---|")
    prompts = held_out_prompts(tok, 4)
    for name in [n for n in engines if n != "off"]:
        spans.clear()
        spans.enable()
        run(engines[name], prompts)
        spans.disable()
        total = {}
        for ev in spans.events():
            total[ev["name"]] = total.get(ev["name"], 0.0) + ev["dur_ms"] / 1e3
        st = engines[name].engine.stats()
        print(f"| {name} | {total.get('forward', 0):.3f} | {total.get('draft', 0):.3f} | {total.get('replay', 0):.3f} | "
              f"{st['spec_replay_bytes_per_request']:,} |")
    # the flash projection: a verification of K+1 tokens at small batch reads the weights once (~ one
    # decode step, memory-bound), and one draft step runs 1 of flash's 46 layers (45 + MTP)
    from ouro.models.presets import PRESETS
    flash_layers = PRESETS["flash"].num_hidden_layers + 1
    print(f"\nProjected for the flash shape at the same acceptance (batch 1): speed-up = accept length / "
          f"(1 + K / {flash_layers})")
    print("| K | accept length (tiny-py, held-out, batch 4 run) | projected flash speed-up |")
    print("|---|---|---|")
    for k in ks:
        length = engines[f"K={k}"].engine.stats()["spec_accept_length"]
        print(f"| {k} | {length:.2f} | {length / (1 + k / flash_layers):.2f}x |")


if __name__ == "__main__":
    main()
