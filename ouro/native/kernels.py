"""The fused decode kernels: one C++ library per family (`norms.cpp`, `kda.cpp`, ...), each built on
first use (`build.compile_native`) and registered as `torch.ops.ouro_native.*` ops. Each family's
Python module (`norms.py`, ...) registers its ops' fake implementations, so a compiled graph holds
every fused op as one call.

A layer takes the fused path only where `usable(...)` says so: the family built here, fused kernels
not turned off (`OURO_FUSED=0`, `eager_only()`), no autograd, CPU float32 tensors, or bfloat16 ones
for the families in `BFLOAT16` (computed in float32 inside). Everywhere else (no compiler, a GPU,
float16, float64 reference runs, training) the layer's eager code runs: it is also each kernel's
reference in the tests. A family that cannot be built says so once in the log."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch

from ..machine_cache import switched_off
from .build import build_key, build_side_by_side, compile_native

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
HEADERS = (HERE / "vec.h", HERE / "tiles.h", HERE / "by_expert.h", HERE / "boundary.h", HERE / "weight_cache.h")
FAMILIES = ("norms", "mhc", "router", "experts", "kda", "mla", "gemv", "panels", "sample", "onednn")   # one `<family>.cpp` each
# the families whose ops also take a bfloat16 model's tensors: float32 inside, its rows converted at
# the op's boundary (`boundary.h`) or widened as they are read (expert weights, latent cache rows); the
# float32 few-row products (`gemv`, `panels`) do not; oneDNN's packed product (`onednn`) runs either dtype itself
BFLOAT16 = frozenset({"norms", "mhc", "router", "experts", "kda", "mla", "onednn"})
_STATE: dict = {"eager_only": False, "eager_families": frozenset()}
_LOADED: dict[str, str | None] = {}      # family -> None when loaded, else why it is not
_FAKES: dict[str, object] = {}           # family -> function registering its fake implementations


def register_fakes(family: str):
    """Decorator: the function registering `family`'s fake implementations, run once after its load
    (at once where the family was loaded before its module was imported: `load_all()` first)."""
    def wrap(fn):
        _FAKES[family] = fn
        if _LOADED.get(family, "not loaded") is None:
            fn()
        return fn
    return wrap


def register_product(name: str) -> None:
    """The fake of `ouro_native::<name>(x [M, K], w [N, K]) -> [M, N]` and its FLOPs for torch's
    FlopCounterMode (the bench's dispatched FLOPs), as for a matmul: 2 * M * N * K."""
    torch.library.register_fake(f"ouro_native::{name}")(lambda x, w: x.new_empty(x.shape[0], w.shape[0]))
    from torch.utils.flop_counter import flop_registry, register_flop_formula
    op = getattr(torch.ops.ouro_native, name)
    if op not in flop_registry:
        register_flop_formula(op)(lambda x_shape, w_shape, *args, out_shape=None, **kwargs:
                                  2 * x_shape[0] * x_shape[1] * w_shape[0])


def load(family: str) -> bool:
    """Builds and loads `<family>.cpp` once; True when its ops are in `torch.ops.ouro_native`."""
    if family not in _LOADED:
        if torch.compiler.is_compiling():
            raise RuntimeError(f"ouro's fused {family} kernels are loaded inside a graph trace: call "
                               "ouro.native.kernels.load_all() before compiling (a build cannot be traced)")
        if switched_off("OURO_FUSED"):
            _LOADED[family] = "OURO_FUSED=0"
        else:
            path, why = compile_native(f"fused_{family}", HERE / f"{family}.cpp", HEADERS, python_module=False)
            _LOADED[family] = why
            if why is None:
                if family in _FAKES:
                    _FAKES[family]()
            else:
                log.warning("ouro's fused %s kernels are not used on this machine (%s); the eager path runs. "
                            "Install a C++ compiler and `ninja` to build them.", family, why)
    return _LOADED[family] is None


def ops(family: str):
    """`torch.ops.ouro_native` with `family` loaded; a clear error where it cannot be built here."""
    if not load(family):
        raise RuntimeError(f"ouro's fused {family} kernels are not available here ({_LOADED[family]}); "
                           "check `usable(...)` first and take the eager path")
    return torch.ops.ouro_native


def build_id(family: str) -> str:
    """`family`'s build key (its sources and headers, the CPU's flags, torch, the flags): a choice
    timed on another build of a kernel is timed again (`machine.gemm_pick` keys its picks by it);
    'no source' where the sources are not there (then nothing of the family is built either)."""
    files = [HERE / f"{family}.cpp", *HEADERS]
    return build_key(files) if all(f.is_file() for f in files) else "no source"


def why_not(family: str) -> str | None:
    load(family)
    return _LOADED[family]


def usable(family: str, *tensors) -> bool:
    """Whether a layer should run `family`'s fused op on these tensors (see the module's text)."""
    if _STATE["eager_only"] or family in _STATE["eager_families"] or torch.is_grad_enabled():
        return False
    bf16 = family in BFLOAT16
    for t in tensors:
        if t.device.type != "cpu" or not (t.dtype == torch.float32 or (bf16 and t.dtype == torch.bfloat16)):
            return False
    return load(family)


@contextlib.contextmanager
def eager_only(on: bool = True, families: tuple[str, ...] | None = None):
    """Within: every layer takes its eager path (the fused kernels' reference, an A/B's other side).
    `families`: only those families' ops give way to their eager paths, the rest stay fused (one
    kernel family against its reference, the others' float32 rounding the same on both sides)."""
    if families is not None:
        unknown = set(families) - set(FAMILIES)
        if unknown:
            raise ValueError(f"unknown kernel families {sorted(unknown)}; one of {', '.join(FAMILIES)}")
    key, value = ("eager_only", on) if families is None else ("eager_families", frozenset(families) if on else frozenset())
    saved = _STATE[key]
    _STATE[key] = value
    try:
        yield
    finally:
        _STATE[key] = saved


def fused_off() -> bool:
    """Inside `eager_only()`: every fused path (native ops and merged products) is off."""
    return _STATE["eager_only"]


def switches() -> tuple:
    """The fused paths' switches as they stand (`eager_only()` and the families it names): a traced
    graph holds the paths these chose, so a graph called without its guards is keyed by them."""
    return _STATE["eager_only"], _STATE["eager_families"]


def builds() -> list[tuple[str, Path, tuple[Path, ...]]]:
    """(name, source, headers) of each family's build, for `build.build_side_by_side`."""
    return [(f"fused_{f}", HERE / f"{f}.cpp", HEADERS) for f in FAMILIES]


def load_all() -> dict[str, bool]:
    """Every family built and loaded (or its reason recorded): before a graph is traced, so the
    trace reads each family's state and never starts a build. Families not built yet build side by
    side."""
    if not switched_off("OURO_FUSED") and any(f not in _LOADED for f in FAMILIES):
        build_side_by_side(builds())
    return {f: load(f) for f in FAMILIES}


def isa(family: str) -> str:
    """The instruction set `family`'s kernels run here: 'avx512', 'avx2' or 'portable'."""
    if not load(family):
        return "none"
    return getattr(torch.ops.ouro_native, f"{family}_isa")(-1)


@contextlib.contextmanager
def portable(family: str):
    """Within: `family`'s kernels run their portable loops (each path is tested on one machine)."""
    load(family)
    op = getattr(torch.ops.ouro_native, f"{family}_isa")
    saved = op(-1) == "portable"
    op(1)
    try:
        yield
    finally:
        op(int(saved))
