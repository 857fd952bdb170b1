"""Host synchronisations inside a forward: each one stalls the host until the device catches up,
and a step that has one cannot be captured into a CUDA graph.

Seen at two levels: aten ops while an `OpRecorder` runs (`_local_scalar_dense` is `.item()`,
`int(t)`, `float(t)`, `bool(t)`; ops whose output shape depends on the data, such as `nonzero`
or boolean-mask indexing), and Python methods that leave the device without an aten op
(`.tolist()`, `.numpy()`, `.cpu()`), wrapped on `torch.Tensor` for the recorded step only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .op_record import OpRecorder, ouro_stack

# data-dependent output shapes: the host must learn a device value to size the result
SHAPE_FROM_DATA = {"nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive", "bincount",
                   "argwhere", "nonzero_numpy"}
WRAPPED = ("tolist", "numpy", "cpu")


@dataclass
class SyncRecord:
    kind: str          # "item", "tolist", "numpy", "cpu", "to_host", "shape:<op>", "host_tensor"
    module: str
    stack: tuple       # ouro frames, innermost first
    step: str = ""

    @property
    def frame(self):
        return self.stack[0] if self.stack else ("?", "?", 0)

    @property
    def in_layer(self) -> bool:
        return self.module.startswith("layers.")

    @property
    def blocking(self) -> bool:
        """A host tensor copied in (`torch.tensor(list)`) does not wait for the device; the rest do."""
        return self.kind != "host_tensor"


def _bool_index(args) -> bool:
    idx = args[1] if len(args) > 1 else None
    return isinstance(idx, (list, tuple)) and any(
        isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in idx)


def _leaves_device(name, args, kwargs, out) -> bool:
    """A copy from an accelerator tensor into host memory (`.to("cpu")`, `host.copy_(dev)`)."""
    src = args[1] if name == "copy_" and len(args) > 1 else (args[0] if args else None)
    dst = args[0] if name == "copy_" else out
    return isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor) and \
        src.device.type != "cpu" and dst.device.type == "cpu"


class SyncWatch:
    """Attach to an `OpRecorder`; use `with watch:` around the recorded step (wraps the methods)."""

    def __init__(self, recorder: OpRecorder):
        self.recorder = recorder
        self.syncs: list[SyncRecord] = []
        self.step = ""
        self._saved = {}
        self._inside = 0          # inside a wrapped method: its own aten ops are not counted again
        recorder.listeners.append(self._on_op)

    def _add(self, kind):
        self.syncs.append(SyncRecord(kind, self.recorder.modules.current, ouro_stack(), self.step))

    def _on_op(self, name, args, kwargs, out, rec):
        if self._inside:
            return
        kind = None
        if name == "_local_scalar_dense":
            kind = "item"
        elif name in SHAPE_FROM_DATA:
            kind = f"shape:{name}"
        elif name in ("index", "index_put", "index_put_", "_index_put_impl_") and _bool_index(args):
            kind = f"shape:{name}[bool mask]"
        elif name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) <= 2 \
                and isinstance(args[0], torch.Tensor) and args[0].dtype != torch.bool and \
                not (len(args) > 1 and isinstance(args[1], int)):
            kind = "shape:repeat_interleave"
        elif name == "lift_fresh":
            kind = "host_tensor"
        elif name in ("_to_copy", "copy_") and _leaves_device(name, args, kwargs, out):
            kind = "to_host"
        if kind is not None:
            self.syncs.append(SyncRecord(kind, rec.module, rec.stack, self.step))

    def _wrap(self, name):
        original = self._saved[name][1]
        watch = self

        def wrapper(t, *a, **k):
            if watch._inside == 0:
                watch._add(name)
            watch._inside += 1
            try:
                return original(t, *a, **k)
            finally:
                watch._inside -= 1
        return wrapper

    def __enter__(self):
        for name in WRAPPED:
            self._saved[name] = (torch.Tensor.__dict__.get(name), getattr(torch.Tensor, name))
            setattr(torch.Tensor, name, self._wrap(name))
        return self

    def __exit__(self, *exc):
        for name, (own, _) in self._saved.items():
            if own is None:
                delattr(torch.Tensor, name)   # inherited from the C base: drop our override
            else:
                setattr(torch.Tensor, name, own)
        self._saved = {}
        return False
