"""The int8 kernel of this tree against the same kernel at another revision, in one process, calls
interleaved: the other revision's `int8_mm.cpp` (and the headers beside it) is built with its op
namespace renamed (`-Douro_int8=ouro_int8_base`), so both builds' ops are loaded side by side. Each
case checks the two give equal results, then times `--rounds` alternating calls and prints medians.

    python benchmarks/int8_ab.py --base 2d53990
    python benchmarks/int8_ab.py --base HEAD --base-cflags=-DOURO_NO_512   # the 512-bit path against the 256-bit one

A C++ change's effect of a few microseconds a call is below what separate processes resolve on a
shared VM (the same command moves 20-40% between runs there); side by side in one process it is not.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from ouro.native.build import CFLAGS  # noqa: E402
from ouro.ops.quant import quantize_rows  # noqa: E402
from ouro.quant.int8_native import native  # noqa: E402

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
FILES = {"ouro/quant/int8_mm.cpp": "int8_mm.cpp", "ouro/quant/int8_products.h": "int8_products.h",
         "ouro/native/vec.h": "vec.h", "ouro/native/by_expert.h": "by_expert.h", "ouro/native/tiles.h": "tiles.h"}


def build_base(rev: str, directory: str, cflags: list[str] = ()):
    """The kernel's files at `rev`, built as a module whose ops are `torch.ops.ouro_int8_base`
    (`cflags`: extra flags for that build only, e.g. `-DOURO_NO_512` for the 256-bit path)."""
    from torch.utils import cpp_extension
    for path, name in FILES.items():
        text = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=REPO, capture_output=True, text=True)
        if text.returncode == 0:            # a header the revision does not have is not needed by it
            with open(os.path.join(directory, name), "w") as f:
                f.write(text.stdout)
    tag = "".join(c for c in "_".join([rev, *cflags]) if c.isalnum() or c == "_")
    return cpp_extension.load(name=f"ouro_int8_base_{tag}", sources=[os.path.join(directory, "int8_mm.cpp")],
                              extra_cflags=[*CFLAGS, *cflags, "-Douro_int8=ouro_int8_base"],
                              extra_include_paths=[directory], verbose=False)


def cases(gen):
    """(name, call(module)) pairs; each module runs on weights it packed itself (the two revisions'
    packed layouts may differ)."""
    none = torch.zeros(0, dtype=torch.long)
    packs: dict = {}

    def packed(m, q):
        key = (id(m), id(q))
        if key not in packs:
            packs[key] = m.pack_weight(q)
        return packs[key]
    out = []
    for n, k in ((1536, 512), (512, 512)):
        q, s = quantize_rows(torch.randn(n, k, generator=gen))
        q = q.unsqueeze(0)
        for rows in (1, 4, 16, 64, 256, 2048):
            x = torch.randn(rows, k, generator=gen)
            out.append((f"w8a8_packed {n} x {k}, {rows} rows",
                        lambda m, x=x, q=q, s=s, n=n: m.w8a8_packed(x, packed(m, q), s, none, n)))
    E, D, I = 32, 512, 256
    gu_q, gu_s = quantize_rows(torch.randn(E, 2 * I, D, generator=gen))
    dn_q, dn_s = quantize_rows(torch.randn(E, D, I, generator=gen))
    for tokens in (1, 16, 512, 2048):
        x, w = torch.randn(tokens, D, generator=gen), torch.rand(tokens, 4, generator=gen)
        ex = torch.stack([torch.randperm(E, generator=gen)[:4] for _ in range(tokens)])
        out.append((f"w8a8_experts {E} x {D} x {I}, {tokens} tokens",
                    lambda m, x=x, w=w, ex=ex: m.w8a8_experts(x, w, ex, packed(m, gu_q), gu_s, packed(m, dn_q), dn_s,
                                                              I, 10.0)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the git revision to compare against")
    ap.add_argument("--base-cflags", default="", help="extra compiler flags for the base build only, "
                    "e.g. '-DOURO_NO_512' (with --base HEAD: this tree's 256-bit VNNI path against its 512-bit one)")
    ap.add_argument("--rounds", type=int, default=200)
    a = ap.parse_args()
    this = native()
    if this is None:
        sys.exit("ouro's int8 kernel is not built here")
    with tempfile.TemporaryDirectory() as d:
        base = build_base(a.base, d, a.base_cflags.split())
        print(f"{torch.get_num_threads()} threads; medians of {a.rounds} alternating calls")
        print("| case | base, us | this tree, us | base - this, us |\n|---|---|---|---|")
        for name, call in cases(torch.Generator().manual_seed(0)):
            if not torch.equal(call(base), call(this)):
                sys.exit(f"{name}: the two builds disagree")
            times = {"base": [], "this": []}
            rounds = max(10, a.rounds if "2048" not in name and "512 tok" not in name else a.rounds // 10)
            for r in range(rounds):
                for key, mod in (("base", base), ("this", this))[::1 if r % 2 else -1]:
                    t = time.perf_counter()
                    call(mod)
                    times[key].append(time.perf_counter() - t)
            b, t = (1e6 * statistics.median(times[k]) for k in ("base", "this"))
            print(f"| {name} | {b:.1f} | {t:.1f} | {b - t:+.1f} |")


if __name__ == "__main__":
    main()
