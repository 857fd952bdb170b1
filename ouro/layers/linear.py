"""`Linear`: an `nn.Linear` whose product runs the way this machine runs it fastest for the row
count at hand (`forms`, one per row count in `ouro.machine.gemm_pick.ROWS`, set by the engine from a
measurement; None: always `F.linear`). Same parameters, same state dict, same hooks as
`nn.Linear`. The packed form uses a oneDNN copy of the weight (`gemm_pick.packed_for`); the gemv
and panels forms are ouro's native kernels, fused paths like the others: `F.linear` runs instead
wherever their `can` says no (inside `eager_only()`, the reference; autograd; not float32)."""

import torch
import torch.nn.functional as F
from torch import nn

from ..machine.gemm_pick import form_for, packed_for, pick_forms, product
from ..machine.model_forms import prepack
from ..native import gemv, onednn, panels
from ..ops import batch_invariant
from ..ops.opaque import call_opaque

NATIVE = {"gemv": gemv, "panels": panels}     # the forms that are ouro's native kernels: form -> module


class Linear(nn.Linear):
    forms = None

    def forward(self, x):
        # a compiled graph holds every form as a direct op: oneDNN's packed copy cannot be traced, so
        # the packed form is `onednn.packed_linear` on the plain weight (the op keeps the packed copy),
        # or, where that op is not built, the product as one opaque op (back into Python)
        if self.forms is not None and torch.compiler.is_compiling() and self.form(x) == "packed" \
                and not onednn.can(x, self.weight):
            return call_opaque(self, x)
        return self.eager(x)

    def form(self, x) -> str:
        """The product form x's row count takes ('linear': F.linear, with the bias)."""
        if self.forms is None or self.bias is not None or torch.is_grad_enabled() or batch_invariant.enabled():
            return "linear"
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        form = form_for(self.forms, rows)
        native = NATIVE.get(form)
        return "linear" if rows == 0 or (native is not None and not native.can(x, self.weight)) else form

    def eager(self, x):
        form = self.form(x)
        if form == "linear":
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(-1, x.shape[-1])
        # the packed form: native's op where it is built (it keeps the packed copy), else this module's copy
        packed = packed_for(self, self.packed_weights())[0] if form == "packed" and not onednn.can(flat, self.weight) \
            else None
        return product(flat, self.weight, form, packed).view(*x.shape[:-1], self.out_features)

    def eager_shape(self, x):
        return (*x.shape[:-1], self.out_features), x.dtype

    def packed_weights(self):
        return [self.weight]

    @classmethod
    def merge(cls, modules):
        """One Linear with `modules`' weights stacked (`ouro.layers.merged`); its product form is
        measured for its own shape where the sources run measured forms."""
        if any(m.bias is not None or m.in_features != modules[0].in_features for m in modules):
            return None
        w = torch.cat([m.weight.detach() for m in modules])
        out = cls(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
        out.weight = nn.Parameter(w, requires_grad=False)
        if modules[0].forms is not None:
            out.forms = pick_forms(out.weight)
            prepack(out)
        return out
