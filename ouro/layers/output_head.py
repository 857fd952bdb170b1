"""The output projection (hidden -> vocabulary logits): an `nn.Linear` that can run its product
the other way round, `(W @ x.T).T`, where this machine's BLAS runs that faster for a few rows
against a large weight (see `ouro.gemm_pick`; the engine sets `forms` by measurement).
Same parameters, same state dict, same hooks as `nn.Linear`."""

import torch.nn.functional as F
from torch import nn

from ..gemm_pick import form_for, product


class OutputHead(nn.Linear):
    forms = None          # per row count in ouro.gemm_pick.ROWS; None: always F.linear

    def forward(self, x):
        if self.forms is not None and self.bias is None and x.dim() == 2:
            return product(x, self.weight, form_for(self.forms, x.shape[0]))
        return F.linear(x, self.weight, self.bias)
