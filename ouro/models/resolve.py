"""Turn what a user typed (a checkpoint directory or a preset name) into a checkpoint directory."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..config import CheckpointError
from ..machine_cache import cache_lock, cache_root
from .presets import BUILTIN_DIR, CONFIG_ONLY, PRESETS, TRAINED, make_model

# the model a command uses when none is named (a preset name or a directory)
DEFAULT_MODEL = "tiny-py"   # the trained built-in model: serve, generate and eval use it
BENCH_MODEL = "small"       # benchmarks keep the larger random-init shape


def resolve_model(name_or_dir: str, progress: bool = True) -> Path:
    """A directory is used as is; a preset name is written once under $OURO_CACHE (default
    ~/.cache/ouro) by `make_model` and reused afterwards."""
    path = Path(name_or_dir)
    if path.is_dir():
        return path
    if name_or_dir in TRAINED:
        target = BUILTIN_DIR / name_or_dir
        if not (target / "config.json").is_file():
            raise CheckpointError(f"the trained preset {name_or_dir!r} is not installed ({target} is missing); "
                                  f"reinstall ouro, or train it: ouro train --preset {name_or_dir} --output DIR")
        return target
    if name_or_dir in PRESETS:
        if name_or_dir in CONFIG_ONLY:
            raise CheckpointError(f"preset {name_or_dir!r} is config-only (no weights); use it for memory planning")
        target = cache_root() / "presets" / name_or_dir
        if not _ready(target):
            with cache_lock(target.parent / f"{name_or_dir}.lock"):
                if not _ready(target):     # else another process wrote it while this one waited
                    _write_preset(name_or_dir, target, progress)
        return target
    raise CheckpointError(f"{name_or_dir!r} is neither a checkpoint directory nor a preset ({', '.join(PRESETS)})")


def _ready(target: Path) -> bool:
    return (target / "config.json").is_file() and any(target.glob("*.safetensors")) and _current(target)


def _write_preset(name: str, target: Path, progress: bool) -> None:
    """Written beside its place and moved in whole: a process that finds the directory finds all of
    it (test workers and servers start side by side on a fresh cache), and a stale entry goes only
    once its replacement is complete."""
    partial = target.parent / f".{name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    make_model(name, partial, progress=progress, overwrite=True)
    shutil.rmtree(target, ignore_errors=True)
    os.rename(partial, target)


def _current(target: Path) -> bool:
    """The cached preset was written by this version's make_model (else it is rebuilt)."""
    import json
    from .presets import PRESET_FORMAT
    marker = target / "ouro_preset.json"
    try:
        return json.loads(marker.read_text()).get("format") == PRESET_FORMAT
    except (OSError, ValueError):
        return False


def load_tokenizer(directory: Path):
    """The checkpoint's `tokenizers` tokenizer, or None when it ships without one."""
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(path))
