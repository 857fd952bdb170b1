"""Where ouro keeps what it wrote or measured once (`$OURO_CACHE`, default `~/.cache/ouro`), and
the per-machine JSON files that hold measured choices (`dtype_pick`, `gemm_pick`): read whole,
written atomically, keyed by `machine_key`; and `switched_off`, the reading of an OURO_* on/off
variable of the environment. Imports only torch and the standard library."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
from pathlib import Path


CPUINFO = "/proc/cpuinfo"


def switched_off(name: str) -> bool:
    """An on/off environment variable, on unless set to 0 (`OURO_FUSED=0`). Any value but 0 or 1 is
    refused: read as "not 0", `OURO_FUSED=false` would leave the switch on without a word."""
    value = os.environ.get(name, "1").strip()
    if value not in ("0", "1", ""):
        raise ValueError(f"{name} must be 0 (off) or 1 (on), got {value!r}")
    return value == "0"


def cache_root() -> Path:
    return Path(os.environ.get("OURO_CACHE", Path.home() / ".cache" / "ouro"))


@contextlib.contextmanager
def cache_lock(path: Path):
    """One holder at a time across processes, for writing something under the cache that others may
    be about to read or write too (a preset, a kernel build). An OS lock (flock): released with the
    process that holds it, killed or not, so a crash never leaves it held."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def machine_key(device: str) -> str:
    """Device name (on a CPU: its model, family, flags and thread count) and torch version."""
    import torch
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(device))
    else:
        name = f"{_cpu_model()} threads={torch.get_num_threads()}"
    return f"{device}|{name}|torch {torch.__version__}"


def _cpu_model() -> str:
    """The CPU as a cached choice must know it. The model name alone is not enough: cloud VMs of
    three AMD generations (Zen 3 with AVX2 only, Zen 4 and Zen 5 with AVX-512) all say "AMD EPYC", and
    a cache carried from one to another (a home directory or an image moved between them) handed
    one's timed choices to the other. Family, model and a digest of the flags tell them apart."""
    fields = cpu_fields()
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" not in fields and "flags" not in fields:
        return name
    flags = hashlib.sha256(" ".join(sorted(fields.get("flags", "").split())).encode()).hexdigest()[:8]
    return f"{name} (family {fields.get('cpu family', '?')} model {fields.get('model', '?')}, flags {flags})"


def cpu_fields() -> dict[str, str]:
    """The first processor's entries in /proc/cpuinfo, by exact name ({} where there is none)."""
    out: dict[str, str] = {}
    try:
        with open(CPUINFO) as fh:
            for line in fh:
                if not line.strip():
                    break
                key, sep, value = line.partition(":")
                if sep:
                    out.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return out


def cpuinfo(*fields: str) -> str:
    """The first of `fields` /proc/cpuinfo has (e.g. "model name", "flags"), else the platform's name."""
    try:
        with open(CPUINFO) as fh:
            for line in fh:
                if line.startswith(fields):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def read(name: str) -> dict:
    """The JSON object in `$OURO_CACHE/name`, or {} (missing or corrupt: measured again)."""
    try:
        data = json.loads((cache_root() / name).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def write(name: str, data: dict) -> None:
    """Atomically (two servers starting at once never read half a file); a read-only home is
    skipped: the choice is measured again next time."""
    path = cache_root() / name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
    except OSError:
        pass
