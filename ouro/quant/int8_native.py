"""ouro's own int8 product (`int8_mm.cpp`), compiled on first use for this CPU and cached.

torch has no int8 kernel that keeps per-token activation scales and runs fast on every CPU:
`torch._int_mm` is a slow fallback on an AVX2-only CPU (0.5 GOP/s measured), and fbgemm's
`quantized::linear_dynamic` quantises the whole activation tensor with one scale (a request's
output would depend on its batch). So the product is ours: built with torch's
`cpp_extension` (ninja, a C++ compiler) and `-march=native` into `$OURO_CACHE/ext/`, keyed by the
source, the CPU's flags and torch's version; a machine without a compiler gets `None` and the
reason, once, and the quantised layers use a form that runs (`int8_forms`)."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import torch

from ..machine_cache import cache_root, cpuinfo

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("int8_mm.cpp")
# -fopenmp at compile time only: at::parallel_for then runs on torch's own OpenMP runtime (its GOMP symbols
# resolve through libtorch at load time); without it the kernel ran on one thread, and linking
# -lgomp would load a second OpenMP runtime beside torch's
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
_STATE: dict = {}


def build_key() -> str:
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), cpuinfo("flags", "Features").encode(), torch.__version__.encode(), " ".join(CFLAGS).encode()):
        h.update(part)
    return h.hexdigest()[:16]


def native():
    """The compiled module (`int8_mm(x, w)`, `features()`), or None where it cannot be built here
    (`why_not()` says why). `OURO_INT8_NATIVE=0` turns it off."""
    if "module" not in _STATE:
        _STATE["module"], _STATE["why"] = _load()
        if _STATE["module"] is None:
            log.warning("ouro's int8 kernel is not used on this machine (%s); W8A8 products fall back to "
                        "torch forms (slower). Install a C++ compiler and `ninja` to build it.", _STATE["why"])
    return _STATE["module"]


def why_not() -> str | None:
    native()
    return _STATE["why"]


def _load():
    if os.environ.get("OURO_INT8_NATIVE", "1") == "0":
        return None, "OURO_INT8_NATIVE=0"
    try:
        from torch.utils import cpp_extension
        cpp_extension.verify_ninja_availability()
        key = build_key()
        directory = cache_root() / "ext" / f"int8_mm_{key}"
        directory.mkdir(parents=True, exist_ok=True)
        # compiled from a copy inside the build directory: another checkout of the same source (the
        # fault suite's patched copies, a worktree) then finds the build done instead of redoing it
        source = directory / SOURCE.name
        if not source.is_file() or source.read_bytes() != SOURCE.read_bytes():
            tmp = source.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(SOURCE.read_bytes())
            tmp.replace(source)
        module = cpp_extension.load(name=f"ouro_int8_mm_{key}", sources=[str(source)], extra_cflags=CFLAGS,
                                    build_directory=str(directory), verbose=False)
        return module, None
    except Exception as e:                         # noqa: BLE001 - no compiler, no ninja, a failed build
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return None, f"{type(e).__name__}: {first[:300]}"
