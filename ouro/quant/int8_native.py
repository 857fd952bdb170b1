"""ouro's own int8 product (`int8_mm.cpp`), compiled on first use for this CPU and cached.

torch has no int8 kernel that keeps per-token activation scales and runs fast on every CPU:
`torch._int_mm` is a slow fallback on an AVX2-only CPU (0.5 GOP/s measured), and fbgemm's
`quantized::linear_dynamic` quantises the whole activation tensor with one scale (a request's
output would depend on its batch). So the product is ours: built with torch's
`cpp_extension` (ninja, a C++ compiler) and `-march=native` into `$OURO_CACHE/ext/`, keyed by the
source, the CPU's flags and torch's version; a machine without a compiler gets `None` and the
reason, once, and the quantised layers use a form that runs (`int8_forms`)."""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

from ..native.build import build_key, compile_native
from ..native.kernels import fused_off
from ..ops.quant import quantize_rows

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("int8_mm.cpp")
BY_EXPERT = Path(__file__).parent.parent / "native" / "by_expert.h"    # the routed pairs' order, shared
VEC = Path(__file__).parent.parent / "native" / "vec.h"    # `prefetch`, shared (tiles.h comes with it)
TILES = VEC.with_name("tiles.h")
_STATE: dict = {}


def native():
    """The compiled module (`int8_mm(x, w)`, `features()`), or None where it cannot be built here
    (`why_not()` says why). `OURO_INT8_NATIVE=0` turns it off."""
    if "module" not in _STATE:
        _STATE["module"], _STATE["why"] = _load()
        if _STATE["module"] is not None:
            _register_fakes()
        if _STATE["module"] is None:
            log.warning("ouro's int8 kernel is not used on this machine (%s); W8A8 products fall back to "
                        "torch forms (slower). Install a C++ compiler and `ninja` to build it.", _STATE["why"])
    return _STATE["module"]


def why_not() -> str | None:
    native()
    return _STATE["why"]


BUILD = ("int8_mm", SOURCE, (SOURCE.with_name("int8_products.h"), BY_EXPERT, VEC, TILES))   # (name, source, headers)


@functools.cache
def build_id() -> str:
    """The kernel's build key (its sources, the CPU's flags, torch): a choice timed on another build of
    it is timed again (the VNNI path's products took half the time after the offset change)."""
    return build_key([BUILD[1], *BUILD[2]])


def _load():
    if os.environ.get("OURO_INT8_NATIVE", "1") == "0":
        return None, "OURO_INT8_NATIVE=0"
    return compile_native(*BUILD)


def _register_fakes():
    """Shapes of the build's torch ops (`torch.ops.ouro_int8.*`), for a compiled graph's trace."""
    import torch
    torch.library.register_fake("ouro_int8::w8a8_packed")(
        lambda x, p, w_scale, offsets, N: x.new_empty(x.shape[0], N))
    torch.library.register_fake("ouro_int8::quantize_int8")(
        lambda x: (torch.empty(x.shape, dtype=torch.int8, device=x.device), x.new_empty(x.shape[0])))
    torch.library.register_fake("ouro_int8::w8a8_experts")(
        lambda x, weights, experts, gate_up, gate_up_scale, down, down_scale, I, limit: torch.empty_like(x))


def quantize_for_int8(x):
    """x [M, K] -> (int8 q, float32 scale): `quantize_rows`' values, by ouro's one-pass op where it is
    built (torch's ~8 element-wise ops took ~3.4 ms for a 2,048-row prefill input on the Xeon), by
    torch's ops under `eager_only()` (the reference) or elsewhere."""
    if x.device.type == "cpu" and x.dim() == 2 and not fused_off() and native() is not None:
        return torch.ops.ouro_int8.quantize_int8(x.float())
    return quantize_rows(x)
