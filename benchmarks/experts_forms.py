"""The routed experts' two native forms side by side, one process, rounds alternating: the streamed
form (each expert's weights streamed once for its rows) and the tiled form (a grouped GEMM over packed
panels), at several token counts. The streamed form is the in-process control when only the tiled one
changes (compare the tiled / streamed ratio between builds, not the milliseconds: a shared machine's
speed moves between processes).

    python benchmarks/experts_forms.py [--tokens 64,128,256,512] [--experts 32 --top-k 4 --hidden 512 --inter 256]
"""

import argparse
import statistics
import time

import torch

from ouro.native import experts as native_experts


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="64,128,256,512")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--inter", type=int, default=256)
    p.add_argument("--rounds", type=int, default=15)
    a = p.parse_args()
    E, k, D, I = a.experts, a.top_k, a.hidden, a.inter
    g = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(E, 2 * I, D, generator=g) * 0.05, torch.randn(E, D, I, generator=g) * 0.05
    with torch.no_grad():
        for T in (int(t) for t in a.tokens.split(",")):
            x, w = torch.randn(T, D, generator=g), torch.rand(T, k, generator=g)
            ex = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
            times = {False: [], True: []}
            for r in range(a.rounds):
                for tiled in ((False, True) if r % 2 else (True, False)):
                    t0 = time.perf_counter()
                    native_experts.moe_experts(x, w, ex, gate_up, down, 7.0, tiled)
                    times[tiled].append(time.perf_counter() - t0)
            s, t = statistics.median(times[False]), statistics.median(times[True])
            flops = 2 * T * k * 3 * I * D
            print(f"{T} tokens ({T * k / E:.0f} rows an expert): streamed {1e3 * s:.2f} ms ({flops / s / 1e9:.0f} GFLOP/s), "
                  f"tiled {1e3 * t:.2f} ms ({flops / t / 1e9:.0f} GFLOP/s), tiled / streamed {t / s:.2f}")


if __name__ == "__main__":
    main()
