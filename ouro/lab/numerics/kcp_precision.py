"""`ouro probe numerics --kcp-sweep 1024,4096,...`: the error of each KCP precision mode against
float64, by context length and by position.

For each context length, KDA inputs shaped like the model's KDA layers are generated: its heads
and head dims, L2-normalised q and k, and slow log-decays in the model's gate range, so the state
carries far and errors carry with it. They are cut into slices of `slice_len` tokens (one per
rank of a context-parallel prefill) and run through `ouro.ops.kda.cp.kda_sliced` in every mode.
Each mode is compared with one unsplit float64 run. The findings name the chain
(`ouro/ops/kda/cp.py`, `chain_states`) when a mode's error at the longest context is far above
fp32's, or grows with context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..findings import Finding
from ..kernels.refs import rel_rms

GROWTH = 1.5      # error at the longest context over the shortest: above this the error grows
FAR = 10.0        # a mode's error over fp32's: above this it is flagged
# modes that claim float32 accuracy: an error above this is a fault in the chain, not a precision
# trade-off (what float32 reaches here: about 1e-7)
CLAIMS_FP32 = {"fp32": 1e-5, "tf32x3": 1e-5}


def _inputs(config, T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    H, d = config.linear_num_heads, config.linear_head_dim
    q = F.normalize(torch.randn(1, T, H, d, generator=g), dim=-1) * d ** -0.5
    k = F.normalize(torch.randn(1, T, H, d, generator=g), dim=-1)
    v = torch.randn(1, T, H, d, generator=g)
    lb = config.linear_lower_bound if config.linear_lower_bound is not None else -5.0
    gate = lb * 1e-4 * torch.sigmoid(torch.randn(1, T, H, d, generator=g))     # slow: the state carries across slices
    beta = torch.sigmoid(torch.randn(1, T, H, generator=g))
    return q, k, v, gate, beta


def sweep(config, contexts, slice_len: int = 1024, chunk_size: int = 16, bins: int = 8, seed: int = 0) -> dict:
    """{precision: {context: error of the final state}, 'positions': {precision: [error per position bin at the
    longest context]}}."""
    from ...ops.kda import kda_chunk
    from ...ops.kda.cp import PRECISIONS, kda_sliced
    out = {p: {} for p in PRECISIONS}
    out["positions"] = {}
    for T in sorted(contexts):
        q, k, v, g, beta = _inputs(config, T, seed)
        o64, s64 = kda_chunk(*(t.double() for t in (q, k, v, g, beta)), chunk_size=chunk_size)
        cuts = tuple(range(slice_len, T, slice_len))
        for p in PRECISIONS:
            o, s = kda_sliced(q, k, v, g, beta, None, cuts, chunk_size, p)
            out[p][T] = rel_rms(s.double(), s64)
            if T == max(contexts):
                edges = torch.linspace(0, T, bins + 1).long().tolist()
                out["positions"][p] = [rel_rms(o[:, a:b].double(), o64[:, a:b]) for a, b in zip(edges, edges[1:])]
    return out


def sweep_findings(result: dict, slice_len: int) -> list[Finding]:
    contexts = sorted(result["fp32"])
    longest, shortest = contexts[-1], contexts[0]
    base = result["fp32"][longest]
    table = {p: {str(c): f"{e:.2e}" for c, e in result[p].items()} for p in result if p != "positions"}
    evidence = {"final-state error by context": table,
                f"output error by position bin at {longest} tokens": {p: [f"{e:.1e}" for e in v]
                                                                      for p, v in result["positions"].items()}}
    findings, broken = [], set()
    for p, bound in CLAIMS_FP32.items():
        worst = max(result[p].values())
        if worst > bound:
            broken.add(p)
            findings.append(Finding(
                "numerics", "error", f"KCP chain configured {p}: final-state error {worst:.1e} against float64 exceeds "
                f"float32's {bound:.0e} (the state products are not computing in {p})", {"file": "ouro/ops/kda/cp.py", "function": "_mm"},
                measured={"error": worst}, expected={"max_error": bound}, evidence=evidence,
                next="check which precision the chain's products actually run in"))
    for p in result:
        if p in ("positions", "fp32") or p in broken:
            continue
        err = result[p][longest]
        growth = err / max(result[p][shortest], 1e-30)
        far = err / max(base, 1e-30)
        if far > FAR or (growth > GROWTH and far > 2):
            findings.append(Finding(
                "numerics", "warning",
                f"KCP chain in {p}: final-state error {err:.1e} at {longest:,} tokens is {far:.0f}x fp32's"
                + (f", and grows {growth:.1f}x from {shortest:,} tokens" if growth > GROWTH else ""),
                {"file": "ouro/ops/kda/cp.py", "function": "chain_states"},
                measured={"error": err, "fp32_error": base, "growth": growth, "slices": longest // slice_len},
                evidence=evidence, next="run the chain's products in fp32 or tf32x3"))
    findings.append(Finding("numerics", "info", "KCP precision sweep: " + "; ".join(
        f"{p} {result[p][longest]:.1e}" for p in table) + f" at {longest:,} tokens ({longest // slice_len} slices)",
        {"file": "ouro/ops/kda/cp.py", "function": "chain_states"}, evidence=evidence))
    return findings
