"""`ouro lab quant-policy`: the cheapest per-layer quantisation policy within a quality budget, for
the weights (`--target weights`: W8A8 per decoder layer) or the KV cache (`--target kv`: quantised
rows per DSA layer).

Held-out bits/byte (the `ouro eval ppl` yardstick, on a prefix of the held-out split) is measured
for the unquantised model, for the quantisation everywhere, and for it everywhere but one layer at
a time: a layer's contribution is what keeping it unquantised buys back. Layers are then kept in
full precision, largest contribution first, until the measured policy is within the budget (a
relative bits/byte increase); the policy is printed as the flags to use. Each evaluation runs the
real engine (`LLM`), so the figure is what serving with those flags gives.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field


@dataclass
class Policy:
    model: str
    budget: float                       # allowed relative increase of bits/byte
    baseline: float                     # bits/byte, unquantised
    all_quantised: float                # bits/byte, quantised everywhere (weights: the default ignore list)
    per_layer: dict = field(default_factory=dict)   # layer -> bits/byte with that layer kept unquantised
    kept_layers: list = field(default_factory=list)
    chosen: float = 0.0                 # bits/byte of the chosen policy
    n_bytes: int = 0
    seconds: float = 0.0
    target: str = "weights"
    flags: str = ""

    def format(self) -> str:
        rel = lambda b: f"{b:.6f} ({100 * (b / self.baseline - 1):+.3f}%)"   # noqa: E731
        what = "W8A8" if self.target == "weights" else "KV rows"
        lines = [f"quant-policy ({self.target}) on {self.model}: {self.n_bytes:,} held-out bytes, "
                 f"budget +{100 * self.budget:.2f}%",
                 f"  unquantised        {self.baseline:.6f}", f"  {what} everywhere {rel(self.all_quantised)}"]
        lines += [f"  layer {i} kept        {rel(b)}" for i, b in sorted(self.per_layer.items())]
        state = "within" if self.chosen <= self.baseline * (1 + self.budget) else "NOT within"
        lines += [f"chosen: layers kept unquantised {self.kept_layers or 'none'}: {rel(self.chosen)}, {state} budget",
                  f"flags: {self.flags}"]
        return "\n".join(lines)


def _space(target: str, kv_kind: str, directory: str):
    """(the layers a policy keeps or not, LLM options for a kept set, the flags for a kept set)."""
    from ..config import ModelConfig
    from ..quant.w8a8 import UNQUANTISED
    config = ModelConfig.from_hf(directory)
    if target == "weights":
        def ignore(kept):
            return UNQUANTISED + tuple(f"layers.{i}.*" for i in sorted(kept))
        return (list(range(config.num_hidden_layers)),
                lambda kept: dict(quantization="w8a8", quantization_ignore=ignore(kept)),
                lambda kept: f"--quantization w8a8 --quantization-ignore '{','.join(ignore(kept))}'")
    if target == "kv":
        def layers(kept):
            return ",".join(f"{i}:auto" for i in sorted(kept)) or None
        return (list(config.dsa_layers),
                lambda kept: dict(kv_cache_dtype=kv_kind, kv_cache_layer_dtype=layers(kept)),
                lambda kept: f"--kv-cache-dtype {kv_kind}" + (f" --kv-cache-layer-dtype '{layers(kept)}'" if kept else ""))
    raise ValueError(f"--target must be weights or kv, got {target!r}")


def search(model: str, budget: float, max_bytes: int = 40_000, context_len: int = 512, progress: bool = False,
           target: str = "weights", kv_kind: str = "fp8_e4m3") -> Policy:
    from ..engine.llm import LLM
    from ..eval.corpus import load_split
    from ..eval.ppl import evaluate_bits_per_byte
    from ..models.resolve import resolve_model
    if budget < 0:
        raise ValueError(f"--budget must be >= 0 (a relative bits/byte increase, e.g. 0.005), got {budget}")
    t0 = time.perf_counter()
    directory = str(resolve_model(model, progress=progress))
    docs = load_split("held_out", max_bytes=max_bytes)

    layers, options, flags = _space(target, kv_kind, directory)

    def bits(kept=(), quantised=True):
        llm = LLM(directory, dtype="float32", **(options(kept) if quantised else {}))
        return evaluate_bits_per_byte(llm, llm.engine.tokenizer, docs, context_len, progress=False)

    base = bits(quantised=False)
    policy = Policy(model, budget, base.bits_per_byte, bits().bits_per_byte, n_bytes=base.n_bytes, target=target)
    for i in layers:
        policy.per_layer[i] = bits((i,)).bits_per_byte
    gain = sorted(layers, key=lambda i: policy.per_layer[i] - policy.all_quantised)   # most bought back first
    limit = policy.baseline * (1 + budget)
    kept, chosen = [], policy.all_quantised
    while chosen > limit and len(kept) < len(gain):
        kept.append(gain[len(kept)])
        chosen = bits(kept).bits_per_byte
    policy.kept_layers, policy.chosen, policy.flags = sorted(kept), chosen, flags(kept)
    policy.seconds = time.perf_counter() - t0
    return policy


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny-py", help="checkpoint directory or preset name (default: tiny-py)")
    p.add_argument("--target", default="weights", choices=["weights", "kv"],
                   help="weights: W8A8 per decoder layer; kv: quantised KV-cache rows per DSA layer")
    p.add_argument("--kv-cache-dtype", default="fp8_e4m3", choices=["fp8_e4m3", "int8"], help="with --target kv")
    p.add_argument("--budget", type=float, default=0.005,
                   help="allowed relative increase of held-out bits/byte (default 0.005: +0.5%%)")
    p.add_argument("--max-bytes", type=int, default=40_000, help="held-out bytes scored per evaluation")
    p.add_argument("--context-len", type=int, default=512)
    p.add_argument("--json", default=None, metavar="FILE", help="write the policy and every measurement to FILE")


def run(args) -> int:
    import json
    policy = search(args.model, args.budget, args.max_bytes, args.context_len, progress=True, target=args.target,
                    kv_kind=args.kv_cache_dtype)
    print(policy.format())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(policy), f, indent=2)
    return 0
