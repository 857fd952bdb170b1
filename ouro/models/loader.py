"""Read and write `glm5_next` checkpoints in the Hugging Face on-disk layout (what transformers'
`save_pretrained` writes): `model.language_model.*`, per-expert `mlp.experts.E.*_proj`, separate
`q/k/v_conv1d`, `hc_attn_fn` and friends, `lm_head.weight`. Routed experts may also be stored
stacked, one `mlp.experts.gate_up_proj` [E, 2I, D] (gate rows, then up) and one `down_proj`
[E, D, I] per layer (the fused layout some exports write); loading takes either, per layer.

One table (`checkpoint_layout`) maps each model parameter to its on-disk tensors; loading and
writing both use it. Loading goes tensor by tensor, so peak memory is the model plus one tensor.
The vision tower (`model.visual.*`) is its own model: `load_vision` reads it (`has_vision` asks),
`save_weights(..., vision=)` writes it beside the text tensors."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..config import CheckpointError, ModelConfig
from ..config.model import VisionConfig
from .fp8_checkpoint import FP8_DTYPES, SCALE_SUFFIX, FP8Format, check_scale, dequantize
from .skeleton import meta_skeleton

PREFIX = "model.language_model."
VISION_PREFIXES = ("model.visual.", "visual.")   # what save_pretrained writes; older exports
MAX_LISTED = 50   # problems named in one error; a wrong config can mismatch every tensor


@dataclass
class DiskTensors:
    """How one model tensor is stored: `names` on disk, shapes, and how to split/join them."""
    param: str
    names: list[str]
    shapes: list[tuple]
    join: Callable[[list[torch.Tensor]], torch.Tensor]
    split: Callable[[torch.Tensor], list[torch.Tensor]]


def _same(shape):
    return [tuple(shape)], (lambda ts: ts[0]), (lambda t: [t])


def checkpoint_layout(model: torch.nn.Module, stacked_experts: bool = False) -> list[DiskTensors]:
    """Each model tensor's on-disk form; `stacked_experts`: routed experts as one tensor per layer
    and projection instead of one per expert."""
    out = []
    for param, t in model.state_dict().items():
        shape = tuple(t.shape)
        m = re.fullmatch(r"layers\.(\d+)\.(attn|ffn)_hc\.(fn|base|scale)", param)
        e = re.fullmatch(r"layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)", param)
        if m:
            names = [f"{PREFIX}layers.{m[1]}.hc_{m[2]}_{m[3]}"]
            shapes, join, split = _same(shape)
        elif e and stacked_experts:
            names = [f"{PREFIX}layers.{e[1]}.mlp.experts.{e[2]}"]
            shapes, join, split = _same(shape)
        elif e and e[2] == "gate_up_proj":
            E, two_i, D = shape
            base = f"{PREFIX}layers.{e[1]}.mlp.experts"
            names = [f"{base}.{x}.{p}_proj.weight" for x in range(E) for p in ("gate", "up")]
            shapes = [(two_i // 2, D)] * (2 * E)
            join = lambda ts, E=E: torch.stack([torch.cat(ts[2 * x: 2 * x + 2]) for x in range(E)])
            split = lambda t: [h for x in t for h in x.chunk(2)]
        elif e:
            E, D, I = shape
            names = [f"{PREFIX}layers.{e[1]}.mlp.experts.{x}.down_proj.weight" for x in range(E)]
            shapes = [(D, I)] * E
            join, split = torch.stack, (lambda t: list(t.unbind(0)))
        else:
            names = [param if param.startswith("lm_head.") else PREFIX + param]
            shapes, join, split = _same(shape)
        out.append(DiskTensors(param, names, shapes, join, split))
    return out


def _index_files(directory: Path) -> dict[str, Path]:
    """Disk tensor name -> file holding it (single file or sharded with an index)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: directory / v for k, v in weight_map.items()}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: config.json but no *.safetensors weights (a config-only directory, "
                              "as `ouro make-model flash` writes, is for `ouro plan`; point at a checkpoint with weights)")
    where = {}
    for f in files:
        with safe_open(str(f), "pt") as h:
            where.update({k: f for k in h.keys()})
    return where


def vision_layout(vision: torch.nn.Module, prefix: str = VISION_PREFIXES[0]) -> list[DiskTensors]:
    """The vision tower's tensors on disk: its own names under `prefix`, unchanged in shape."""
    return [DiskTensors(param, [prefix + param], *_same(t.shape)) for param, t in vision.state_dict().items()]


def _disk_shapes(where: dict[str, Path]) -> tuple[dict, dict]:
    """Shape and dtype of every tensor on disk, read from the headers (no tensor is loaded)."""
    shapes, dtypes = {}, {}
    for f in sorted(set(where.values())):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                if where.get(k) == f:
                    shapes[k] = tuple(h.get_slice(k).get_shape())
                    dtypes[k] = h.get_slice(k).get_dtype()
    return shapes, dtypes


def _ignored_kind(name: str, config: ModelConfig) -> str | None:
    if name.startswith(VISION_PREFIXES):
        return "vision"
    if re.match(rf"{re.escape(PREFIX)}layers\.(\d+)\.", name):
        if int(name[len(PREFIX) + 7:].split(".")[0]) >= config.num_hidden_layers:
            return "mtp"
    return None


def mtp_head_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The MTP layer's own tensors (besides its decoder block), which every glm5_next MTP layer has."""
    h, a = config.hidden_size, f"{PREFIX}layers.{config.num_hidden_layers}."
    return {a + "enorm.weight": (h,), a + "hnorm.weight": (h,), a + "eh_proj.weight": (h, 2 * h),
            a + "shared_head.norm.weight": (h,)}


def check_checkpoint(model: torch.nn.Module, directory: str | Path, partial: bool = False):
    """Match the files in `directory` against `model`'s tensors (a meta-device model will do, so
    nothing is allocated yet). Raises CheckpointError naming every missing, unexpected or
    mis-shaped tensor. Returns (layout to load, disk name -> file, ignored vision/MTP counts).
    `partial`: `model` holds part of the checkpoint (the MTP layer): other tensors are not unexpected."""
    directory = Path(directory)
    config: ModelConfig = model.config
    where = _index_files(directory)
    layout = [s if s.names[0] in where and s.names != d.names else d      # stacked experts where stored so
              for d, s in zip(checkpoint_layout(model), checkpoint_layout(model, stacked_experts=True))]
    if config.tie_word_embeddings:
        layout = [d for d in layout if not (d.param == "lm_head.weight" and d.names[0] not in where)]
    expected = {n: s for d in layout for n, s in zip(d.names, d.shapes)}
    problems, ignored = [], {"vision": 0, "mtp": 0}
    shapes, dtypes = _disk_shapes(where)
    fp8 = _fp8_format(directory)
    scales = {}
    for name in [k for k in shapes if k.endswith(SCALE_SUFFIX)]:
        weight = name[:-len(SCALE_SUFFIX)]
        scales[weight] = shapes.pop(name)
        if fp8 is None:
            problems.append(f"tensor {name} is a block-FP8 scale but config.json has no quantization_config")
        elif weight not in shapes or dtypes.get(weight) not in FP8_DTYPES:
            problems.append(f"scale {name} belongs to no FP8 weight (the weight is missing or not float8)")
        elif why := check_scale(weight, shapes[weight], scales[weight], fp8):
            problems.append(why)
    for name in sorted(k for k, dt in dtypes.items() if dt in FP8_DTYPES and k not in scales):
        problems.append(f"FP8 tensor {name} has no {name}{SCALE_SUFFIX} (its block scales)")
    for name in sorted(expected.keys() - shapes.keys()):
        problems.append(f"missing tensor {name} (expected shape {list(expected[name])})")
    mtp_heads = mtp_head_shapes(config)
    extra = [n for n in shapes.keys() - expected.keys() if 0 not in shapes[n]]    # zero-size: nothing (no shared MLP)
    for name in sorted(extra) if not partial else ():
        if name in mtp_heads and shapes[name] != mtp_heads[name]:
            problems.append(f"MTP tensor {name} has shape {list(shapes[name])}, expected {list(mtp_heads[name])}")
        elif kind := _ignored_kind(name, config):
            ignored[kind] += 1
        else:
            problems.append(f"unexpected tensor {name} with shape {list(shapes[name])}")
    if not partial and config.has_mtp and ignored["mtp"] and not mtp_heads.keys() <= shapes.keys():
        problems += [f"missing MTP tensor {n} (expected shape {list(mtp_heads[n])})"
                     for n in sorted(mtp_heads.keys() - shapes.keys())]
    for name in sorted(expected.keys() & shapes.keys()):
        if shapes[name] != expected[name]:
            problems.append(f"tensor {name} has shape {list(shapes[name])}, expected {list(expected[name])}")
    _raise_problems(directory, problems)
    return layout, where, ignored, (fp8, {w: w + SCALE_SUFFIX for w in scales})


def _raise_problems(directory, problems: list[str]):
    if problems:
        shown = problems[:MAX_LISTED] + ([f"... and {len(problems) - MAX_LISTED} more"] if len(problems) > MAX_LISTED else [])
        raise CheckpointError(f"{directory}: checkpoint does not match the config ({len(problems)} problems):\n  "
                              + "\n  ".join(shown))


def _fp8_format(directory: Path):
    path = directory / "config.json"
    return FP8Format.from_config(json.loads(path.read_text())) if path.is_file() else None


def load_weights(model: torch.nn.Module, directory: str | Path, progress: bool = False, partial: bool = False) -> dict:
    """Copy a checkpoint into `model` (after `check_checkpoint`). Returns the ignored counts."""
    layout, where, ignored, (fp8, scale_of) = check_checkpoint(model, directory, partial)
    state = model.state_dict()
    handles = {}
    try:
        from tqdm import tqdm
        it = tqdm(layout, desc="loading", unit="tensor", disable=not progress)
        for d in it:
            parts = []
            for n in d.names:
                f = where[n]
                if f not in handles:
                    handles[f] = safe_open(str(f), "pt")
                t = handles[f].get_tensor(n)
                if n in scale_of:           # block-FP8: dequantised here, one tensor at a time
                    s = where[scale_of[n]]
                    if s not in handles:
                        handles[s] = safe_open(str(s), "pt")
                    t = dequantize(t, handles[s].get_tensor(scale_of[n]), fp8)
                parts.append(t)
            with torch.no_grad():
                state[d.param].copy_(d.join(parts))
            del parts
    finally:
        handles.clear()
    if not partial and model.config.tie_word_embeddings and "lm_head.weight" not in [d.param for d in layout]:
        with torch.no_grad():
            state["lm_head.weight"].copy_(state["embed_tokens.weight"])
    return ignored


def save_weights(model: torch.nn.Module, directory: str | Path, max_shard_bytes: int = 2 << 30,
                 progress: bool = False, transform=None, stacked_experts: bool = False,
                 vision: torch.nn.Module | None = None) -> list[Path]:
    """Write the model's tensors in the on-disk layout, sharded with an index when large.
    `transform(disk name, tensor) -> {disk name: tensor}`: what to write instead (the FP8 writer);
    `stacked_experts`: routed experts as one tensor per layer and projection; `vision`: a
    `VisionModel` written under `model.visual.` in the same files."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    todo = [(d, state) for d in checkpoint_layout(model, stacked_experts)]
    if vision is not None:
        todo += [(d, vision.state_dict()) for d in vision_layout(vision)]
    shards, current, size = [], {}, 0
    from tqdm import tqdm
    for d, state in tqdm(todo, desc="writing", unit="tensor", disable=not progress):
        for name, tensor in zip(d.names, d.split(state[d.param].detach())):
            for n, t in (transform(name, tensor) if transform else {name: tensor}).items():
                t = t.contiguous().clone()
                if current and size + t.nbytes > max_shard_bytes:
                    shards.append(current)
                    current, size = {}, 0
                current[n] = t
                size += t.nbytes
    shards.append(current)
    paths = []
    if len(shards) == 1:
        paths.append(directory / "model.safetensors")
        save_file(shards[0], str(paths[0]), metadata={"format": "pt"})
        return paths
    weight_map = {}
    for i, shard in enumerate(shards):
        p = directory / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(p), metadata={"format": "pt"})
        weight_map.update({k: p.name for k in shard})
        paths.append(p)
    total = sum(t.nbytes for s in shards for t in s.values())
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return paths


def load_model(directory: str | Path, dtype=torch.float32, device="cpu", kda_chunk_size: int = 16,
               progress: bool = False, available: int | None = None):
    """Build a `Glm5NextModel` from a checkpoint directory. The weights' presence, names and
    shapes and the memory the model needs are checked on a meta-device model first, so a
    config-only directory or a model too large for the device fails with the figures instead
    of allocating. `available`: bytes the model may use (default: free memory of `device`)."""
    from .glm5_next import Glm5NextModel
    config = ModelConfig.from_hf(directory)
    skeleton = meta_skeleton(config, kda_chunk_size, dtype)
    check_checkpoint(skeleton, directory)
    need = sum(t.numel() * t.element_size() for t in skeleton.state_dict().values())
    have = available if available is not None else device_free_bytes(device)
    if need > have:
        raise CheckpointError(f"{directory}: the model needs {need / 2**30:.2f} GiB ({need:,} bytes) of weights in "
                              f"{str(dtype).replace('torch.', '')} but {device} has {have / 2**30:.2f} GiB "
                              f"({have:,} bytes) available")
    del skeleton
    with torch.device(device):
        model = Glm5NextModel(config, kda_chunk_size).to(dtype)
    report = load_weights(model, directory, progress=progress)
    model.load_report = report
    return model.eval()


def _vision_prefix(where: dict) -> str | None:
    return next((p for p in VISION_PREFIXES if any(k.startswith(p) for k in where)), None)


def has_vision(directory: str | Path) -> bool:
    """Whether the checkpoint holds vision tower tensors (read from the file headers only)."""
    return _vision_prefix(_index_files(Path(directory))) is not None


def load_vision(directory: str | Path, dtype=torch.float32, device="cpu"):
    """The checkpoint's vision tower as a `VisionModel`, or None when it has none (no `vision_config`
    or no `model.visual.*` tensors). Every tower tensor must be there with its shape, and nothing else
    may sit under the prefix: a CheckpointError names each tensor that does not fit."""
    from .vision import VisionModel
    directory = Path(directory)
    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{directory}: no config.json (expected a Hugging Face glm5_next checkpoint directory)")
    vision_config = json.loads(path.read_text()).get("vision_config")
    where = _index_files(directory)
    prefix = _vision_prefix(where)
    if not vision_config or prefix is None:
        return None
    config = VisionConfig.from_hf(vision_config)
    with torch.device("meta"):
        layout = vision_layout(VisionModel(config), prefix)
    where = {k: f for k, f in where.items() if k.startswith(prefix)}
    shapes, dtypes = _disk_shapes(where)
    expected = {d.names[0]: d.shapes[0] for d in layout}
    problems = [f"missing tensor {n} (expected shape {list(expected[n])})" for n in sorted(expected.keys() - shapes.keys())]
    problems += [f"tensor {n} has shape {list(shapes[n])}, expected {list(expected[n])}"
                 for n in sorted(expected.keys() & shapes.keys()) if shapes[n] != expected[n]]
    problems += [f"unexpected tensor {n} with shape {list(shapes[n])}" for n in sorted(shapes.keys() - expected.keys())]
    # block-FP8 exports keep the tower unquantised; a float8 tower tensor is not read as if it were
    problems += [f"tensor {n} is {dt}: ouro reads the vision tower unquantised only"
                 for n, dt in sorted(dtypes.items()) if dt in FP8_DTYPES]
    _raise_problems(directory, problems)
    with torch.device(device):
        model = VisionModel(config).to(dtype)
    state, handles = model.state_dict(), {}
    try:
        for d in layout:
            f = where[d.names[0]]
            if f not in handles:
                handles[f] = safe_open(str(f), "pt")
            with torch.no_grad():
                state[d.param].copy_(handles[f].get_tensor(d.names[0]))
    finally:
        handles.clear()
    return model.eval()


def device_free_bytes(device="cpu") -> int:
    """Free memory of a device: CUDA's free bytes, or MemAvailable of the host."""
    if str(device).startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read available memory from /proc/meminfo")
