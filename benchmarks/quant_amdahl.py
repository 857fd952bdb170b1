"""How much of a `small` step the quantisable products take (float32 and W8A8, interleaved, 5
rounds, medians), and so the largest speed-up any faster product could give (Amdahl): every
projection's and routed-expert block's forward is timed inside a prefill of 16 x 128 tokens and
the decode step after it.

    python benchmarks/quant_amdahl.py
"""
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

warnings.filterwarnings("ignore")
from ouro.engine.simple_runner import SimpleRunner  # noqa: E402
from ouro.layers.linear import Linear  # noqa: E402
from ouro.layers.moe import Experts  # noqa: E402
from ouro.models.loader import load_model  # noqa: E402
from ouro.models.resolve import resolve_model  # noqa: E402
from ouro.quant.w8a8 import W8A8Experts, W8A8Linear, quantize_model  # noqa: E402
d = resolve_model("small")
models = {"float32": load_model(d), "w8a8": load_model(d)}
quantize_model(models["w8a8"])
acc = {"t": 0.0}
def wrap(mod):
    f = mod.forward
    def timed(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); acc["t"] += time.perf_counter() - t; return r
    mod.forward = timed
for name, m in models.items():
    for n, mod in m.named_modules():
        if isinstance(mod, (Linear, Experts, W8A8Linear, W8A8Experts)) and n != "lm_head":
            wrap(mod)
batch, prompt = 16, 128
prompts = [[(7 * i + 3 * j) % 30000 + 10 for j in range(prompt)] for i in range(batch)]
res = {n: {"prefill": [], "decode": [], "prefill_p": [], "decode_p": []} for n in models}
with torch.inference_mode():
    for r in range(6):
        for name in (models if r % 2 == 0 else reversed(list(models))):
            runner = SimpleRunner(models[name], batch, prompt + 8)
            acc["t"] = 0; t = time.perf_counter(); logits = runner.step(prompts); tp = time.perf_counter() - t; pp = acc["t"]
            nxt = [[int(i)] for i in logits.argmax(-1)]
            acc["t"] = 0; t = time.perf_counter(); runner.step(nxt); td = time.perf_counter() - t; dp = acc["t"]
            if r:
                for k, v in (("prefill", tp), ("decode", td), ("prefill_p", pp), ("decode_p", dp)):
                    res[name][k].append(v)
med = {n: {k: statistics.median(v) * 1e3 for k, v in d.items()} for n, d in res.items()}
print("| step | float32 ms (products) | w8a8 ms (products) | speed-up | rest of the step, float32 | bound: float32 / rest |")
print("|---|---|---|---|---|---|")
for step in ("decode", "prefill"):
    f, w = med["float32"], med["w8a8"]
    rest = f[step] - f[step + "_p"]
    print(f"| {step} | {f[step]:.1f} ({f[step+'_p']:.1f}) | {w[step]:.1f} ({w[step+'_p']:.1f}) | {f[step]/w[step]:.2f}x | {rest:.1f} | {f[step]/rest:.2f}x |")
