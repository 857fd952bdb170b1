"""Bytes the fused native ops (`ouro.native`) really move, for the op recorder: an op that reads a
few slots of a state cache or the chosen experts of a stacked weight must not count the whole
tensor it indexes into (the redundancy probe would call a clean decode step 4x its floor)."""

from __future__ import annotations

import torch


def _n(t) -> float:
    return float(t.numel() * t.element_size()) if isinstance(t, torch.Tensor) else 0.0


def _moe_experts(args, out):
    x, weights, experts, gate_up, down = args[:5]
    chosen = float(torch.unique(experts).numel())
    return _n(x) + _n(weights) + _n(experts) + chosen * (_n(gate_up[0]) + _n(down[0])) + _n(out)


def _kda_decode(args, out):
    small = sum(_n(t) for t in args[:10])                     # per-token inputs and the layer's weights
    conv, rec, slots, fresh = args[10:14]
    T = slots.numel()
    return small + 2 * T * (_n(conv[0]) + _n(rec[0])) + _n(slots) + _n(fresh) + _n(out)


def _moe_expert_reads(args):
    chosen = float(torch.unique(args[2]).numel())
    return {3: chosen * _n(args[3][0]), 4: chosen * _n(args[4][0])}


# op name (as the recorder names an op: without namespace and overload) -> bytes(args, out)
NATIVE_BYTES = {"moe_experts": _moe_experts, "kda_decode": _kda_decode}
# op name -> {position of a weight argument: bytes of it the op reads}, where that is not all of it
NATIVE_WEIGHT_READS = {"moe_experts": _moe_expert_reads}
