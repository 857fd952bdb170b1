"""Tensors that stay float32 when a model is cast to a 16-bit dtype.

The checkpoint keeps the router, its correction bias, the KDA short-conv kernels, the forget
gate's `A_log` / `dt_bias` and the hyper-connection `base` / `scale` in float32 (transformers'
`_keep_in_fp32_modules_strict`): rounded to bfloat16 they shift expert choice, decay rates and
stream mixing by more than the rest of the bf16 model's error. A module lists such tensors in
`FLOAT32`; `model.to(torch.bfloat16)` (or `.half()`) then casts everything else and leaves them
float32 with their values untouched. Device moves and float64 casts apply as usual.
"""

import torch
from torch import nn

REDUCED = (torch.bfloat16, torch.float16)


class KeepFloat32(nn.Module):
    """Mixin for modules holding parameters / buffers that must stay float32 at reduced precision."""
    FLOAT32: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        before = {n: getattr(self, n) for n in self.FLOAT32}
        before = {n: t.data for n, t in before.items() if t is not None and t.dtype == torch.float32}
        super()._apply(fn, recurse)
        for n, old in before.items():
            t = getattr(self, n)
            if t.dtype in REDUCED:  # a cast to 16 bits: keep the float32 values, follow the device
                kept = old.to(t.device)
                if n in self._parameters:
                    t.data = kept
                else:
                    self._buffers[n] = kept
        return self
