"""The official block-FP8 checkpoint format (`quantization_config.quant_method: fp8`): a projection's
weight in float8 e4m3 [N, K] beside `<name>_scale_inv` [ceil(N / bn), ceil(K / bk)], one scale per
`weight_block_size` block (float32, or float8 e8m0 powers of two), with
W[i, j] = w_fp8[i, j] * scale_inv[i // bn, j // bk]. Edge blocks are partial: the scale grid is the
ceiling division, never inferred from shapes (a grid that does not match is an error naming the
tensor). Loading dequantises tensor by tensor (`dequantize`), so peak memory stays one tensor above
the model; `fp8_writer.write_fp8_checkpoint` writes the format from any built model."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch

from ..config import CheckpointError

E4M3_MAX = 448.0
FP8_DTYPES = {"F8_E4M3": torch.float8_e4m3fn}
SCALE_SUFFIX = "_scale_inv"
# what the writer keeps in the checkpoint dtype (disk names, fnmatch): the output head, the
# embeddings, norms, the router gate and its bias, the indexer's weights_proj, mHC, the short conv
KEEP = ("lm_head.weight", "*embed_tokens.weight", "*norm*", "*.mlp.gate.weight", "*.weights_proj.weight",
        "*hc_*", "*conv1d*", "*.A_log", "*.dt_bias", "*e_score_correction_bias")


@dataclass
class FP8Format:
    block: tuple[int, int] = (128, 128)
    scale_dtype: torch.dtype = torch.float32
    not_converted: list[str] = field(default_factory=list)

    @classmethod
    def from_config(cls, config: dict) -> "FP8Format | None":
        """The format a config.json declares, or None for an unquantised checkpoint."""
        q = config.get("quantization_config")
        if not q:
            return None
        if q.get("quant_method") != "fp8":
            raise CheckpointError(f"quantization_config.quant_method {q.get('quant_method')!r} is not supported "
                                  "(ouro reads block-FP8 checkpoints, quant_method 'fp8')")
        block = q.get("weight_block_size") or [128, 128]
        if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
            raise CheckpointError(f"quantization_config.weight_block_size must be two positive integers, got {block!r}")
        scale = torch.float8_e8m0fnu if q.get("scale_fmt") == "ue8m0" else torch.float32
        return cls(tuple(block), scale, list(q.get("modules_to_not_convert") or q.get("ignored_layers") or []))

    def to_config(self) -> dict:
        out = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
               "weight_block_size": list(self.block), "modules_to_not_convert": self.not_converted}
        if self.scale_dtype == torch.float8_e8m0fnu:
            out["scale_fmt"] = "ue8m0"
        return out

    def grid(self, shape) -> tuple[int, int]:
        (n, k), (bn, bk) = shape[-2:], self.block
        return -(-n // bn), -(-k // bk)


def check_scale(name: str, weight_shape, scale_shape, fmt: FP8Format) -> str | None:
    """Why `name`'s scale does not fit its weight, or None."""
    want = (*tuple(weight_shape[:-2]), *fmt.grid(weight_shape))
    if tuple(scale_shape) != want:
        return (f"scale {name}{SCALE_SUFFIX} has shape {list(scale_shape)}, expected {list(want)} for weight "
                f"{list(weight_shape)} in blocks of {list(fmt.block)}")
    return None


def _per_value(scale: torch.Tensor, fmt: FP8Format, n: int, k: int) -> torch.Tensor:
    """A block grid of scales [.., gn, gk] spread over the [.., n, k] values it covers (edges cut)."""
    bn, bk = fmt.block
    return scale.to(torch.float32).repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, fmt: FP8Format, dtype=torch.float32) -> torch.Tensor:
    """w_fp8 * scale_inv per block, partial blocks at the edges (the reference formula)."""
    return (weight.to(torch.float32) * _per_value(scale_inv, fmt, *weight.shape[-2:])).to(dtype)


def quantize(weight: torch.Tensor, fmt: FP8Format) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, scale_inv) with the block's largest value at e4m3's largest (or, with e8m0
    scales, the power of two at or above that)."""
    bn, bk = fmt.block
    w = weight.detach().to(torch.float32)
    n, k = w.shape[-2:]
    gn, gk = fmt.grid(w.shape)
    padded = torch.zeros(*w.shape[:-2], gn * bn, gk * bk)
    padded[..., :n, :k] = w
    amax = padded.unflatten(-1, (gk, bk)).unflatten(-3, (gn, bn)).abs().amax(dim=(-3, -1))
    scale = (amax / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    if fmt.scale_dtype == torch.float8_e8m0fnu:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (w / _per_value(scale, fmt, n, k)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale.to(fmt.scale_dtype)


STACKED_EXPERTS = ("*.mlp.experts.gate_up_proj", "*.mlp.experts.down_proj")


def converts(name: str, tensor: torch.Tensor, fmt: FP8Format) -> bool:
    """Whether the writer stores this disk tensor in FP8: a 2-D projection weight or a stacked
    [E, N, K] expert tensor, not kept."""
    projection = ((tensor.dim() == 2 and name.endswith(".weight"))
                  or (tensor.dim() == 3 and any(fnmatch.fnmatchcase(name, p) for p in STACKED_EXPERTS)))
    return (projection and not any(fnmatch.fnmatchcase(name, p) for p in KEEP)
            and not any(name.startswith(m + ".") or fnmatch.fnmatchcase(name, m + "*") for m in fmt.not_converted))
