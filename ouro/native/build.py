"""Compiling ouro's C++ kernels on first use for this CPU, cached under `$OURO_CACHE/ext/`.

One function serves every native source (the W8A8 product, the fused decode ops): the build is
keyed by the sources (headers included), the CPU's flags, torch's version and the flags, made with
torch's `cpp_extension` (ninja, a C++ compiler) and `-march=native`, so the instruction set a
kernel uses is the one this CPU has (AVX-512, AVX2, or the portable loops). A machine without a
compiler gets None and the reason; callers fall back to their eager forms."""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import importlib.util
import os
import shlex
import subprocess
import sys
from pathlib import Path

import torch

from ..machine_cache import cache_lock, cache_root, cpuinfo

# -fopenmp at compile time only: at::parallel_for then runs on torch's own OpenMP runtime (its GOMP
# symbols resolve through libtorch at load time); linking -lgomp would load a second runtime
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
# extra flags for every native build, part of its key: `OURO_NATIVE_CFLAGS=-mno-avx512f` builds the
# AVX2 paths on an AVX-512 machine (how the tests check a narrower path than the CPU's own)
EXTRA_CFLAGS_ENV = "OURO_NATIVE_CFLAGS"


def cflags() -> list[str]:
    return CFLAGS + shlex.split(os.environ.get(EXTRA_CFLAGS_ENV, ""))


def build_key(files: list[Path]) -> str:
    h = hashlib.sha256()
    for part in [f.read_bytes() for f in files] + [cpuinfo("flags", "Features").encode(), torch.__version__.encode(),
                                                    " ".join(cflags()).encode()]:
        h.update(part)
    return h.hexdigest()[:16]


def _paths(name: str, files: list[Path]) -> tuple[Path, Path]:
    """(build directory, the library built there)."""
    key = build_key(files)
    directory = cache_root() / "ext" / f"{name}_{key}"
    return directory, directory / f"ouro_{name}_{key}.so"


def _done(directory: Path, library: Path) -> bool:
    """`built` is written once a build has loaded: a build cut short leaves none."""
    return (directory / "built").is_file() and library.is_file()


def is_built(name: str, source: Path, headers: tuple[Path, ...] = ()) -> bool:
    return _done(*_paths(name, [source, *headers]))


def build_side_by_side(builds: list[tuple[str, Path, tuple[Path, ...]]], workers: int | None = None) -> None:
    """The builds not done yet, each in a child process, `workers` at a time (default: the CPUs).
    A compile is one thread: a first start that needs every kernel family then waits about one
    build per CPU, not all of them in turn (~10 s each on the 2-core machines). A child that fails
    changes nothing: the caller's own `compile_native` then builds it, or reports why not."""
    pending = [b for b in builds if not is_built(*b)]
    if len(pending) < 2:
        return
    code = ("import sys; from pathlib import Path; from ouro.native.build import compile_native; "
            "compile_native(sys.argv[1], Path(sys.argv[2]), tuple(Path(h) for h in sys.argv[3:]), python_module=False)")
    root = str(Path(__file__).resolve().parents[2])

    def one(build):
        name, source, headers = build
        subprocess.run([sys.executable, "-c", code, name, str(source), *map(str, headers)], cwd=root,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)

    with concurrent.futures.ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
        list(pool.map(one, pending))


def compile_native(name: str, source: Path, headers: tuple[Path, ...] = (), python_module: bool = True):
    """(module or library path, None) when built and loaded, (None, why) when it cannot be here.
    `python_module=False` builds a plain library of `TORCH_LIBRARY` ops (loaded into `torch.ops`)."""
    try:
        files = [source, *headers]
        directory, library = _paths(name, files)
        if _done(directory, library):
            return _load(library, python_module), None
        from torch.utils import cpp_extension
        cpp_extension.verify_ninja_availability()
        directory.mkdir(parents=True, exist_ok=True)
        # the real path: build.ninja names it, and a cache reached through a link (a test's fresh
        # $OURO_CACHE linking the machine's `ext/`) must write the same file, or ninja rebuilds all
        directory = directory.resolve()
        library = directory / library.name
        # compiled from copies inside the build directory: another checkout of the same sources (the
        # fault suite's patched copies, a worktree) then finds the build done instead of redoing it
        for f in files:
            copy = directory / f.name
            if not copy.is_file() or copy.read_bytes() != f.read_bytes():
                tmp = copy.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_bytes(f.read_bytes())
                tmp.replace(copy)
        with _build_lock(directory):
            built = cpp_extension.load(name=library.stem, sources=[str(directory / source.name)],
                                       extra_cflags=cflags(), extra_include_paths=[str(directory)],
                                       build_directory=str(directory), verbose=False, is_python_module=python_module)
            (directory / "built").write_text(f"{library.name}\n")
        return (built if python_module else str(library)), None
    except Exception as e:                         # noqa: BLE001 - no compiler, no ninja, a failed build
        lines = str(e).strip().splitlines()
        # a compiler's message names the line at fault; otherwise the exception's first line
        first = next((line for line in lines if "error:" in line), lines[0] if lines else "")
        return None, f"{type(e).__name__}: {first.strip()[:300]}"


@contextlib.contextmanager
def _build_lock(directory: Path):
    """One builder at a time per build directory, across processes. An OS lock (flock) is released
    with the process that holds it, killed or not; torch's own lock file (cpp_extension's `lock`) is
    not: a process killed mid-build left it, and every later start waited on it for ever. Under this
    lock no live ouro builder holds torch's, so one found is stale and is removed."""
    with cache_lock(directory / "build.flock"):
        (directory / "lock").unlink(missing_ok=True)
        yield


def _load(library: Path, python_module: bool):
    """A built library loaded without cpp_extension (no lock, no ninja run): its ops into `torch.ops`,
    or as a Python module named as it was built."""
    if not python_module:
        torch.ops.load_library(str(library))
        return str(library)
    spec = importlib.util.spec_from_file_location(library.stem, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
