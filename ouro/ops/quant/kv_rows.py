"""Quantised KV-cache rows: one token's row of a cache (a DSA latent, an indexer key) stored as bytes
with its own scales, so a row moves, is copied and is shared as one unit (a page copied, a row
sent to a decode worker, a prefix page reused) and can never meet another row's scale.

Layout of an encoded row of d values, groups of `group` (the last may be partial):
  [ d value bytes | ceil(d / group) float32 scales ]           -> d + 4 * ceil(d / group) bytes
e.g. a 512-wide latent: 512 + 16 = 528 bytes (the official 656-byte layout adds 64 bf16 rope dims,
which glm5_next's NoPE attention does not have). Values are float8 e4m3 (scale = group amax / 448)
or int8 (scale = group amax / 127, symmetric). A group of zeros gets scale 0 and decodes to 0.
"""

from __future__ import annotations

import torch

KINDS = {"fp8_e4m3": (torch.float8_e4m3fn, 448.0), "int8": (torch.int8, 127.0)}
GROUP = 128
_TINY = torch.finfo(torch.float32).tiny


def row_bytes(d: int, group: int = GROUP) -> int:
    return d + 4 * -(-d // group)


def _groups(x: torch.Tensor, group: int):
    """x [T, d] -> [T, G, group] zero-padded, and d."""
    T, d = x.shape
    G = -(-d // group)
    padded = x.new_zeros(T, G * group)
    padded[:, :d] = x
    return padded.view(T, G, group), d


def encode_rows(x: torch.Tensor, kind: str, group: int = GROUP) -> torch.Tensor:
    """x [T, d] float -> uint8 [T, row_bytes(d)]: values then their float32 group scales."""
    dtype, top = KINDS[kind]
    g, d = _groups(x.float(), group)
    scale = g.abs().amax(dim=-1) / top                                   # [T, G]
    q = g / scale.clamp_min(_TINY).unsqueeze(-1)
    q = torch.round(q).clamp_(-top, top) if dtype == torch.int8 else q.clamp_(-top, top)
    values = q.to(dtype).view(x.shape[0], -1)[:, :d].contiguous().view(torch.uint8)
    return torch.cat([values, scale.contiguous().view(torch.uint8)], dim=1)


def decode_rows(rows: torch.Tensor, d: int, kind: str, group: int = GROUP) -> torch.Tensor:
    """uint8 [T, row_bytes(d)] -> float32 [T, d]."""
    dtype, _ = KINDS[kind]
    G = -(-d // group)
    values = rows[:, :d].contiguous().view(dtype).float()
    scale = rows[:, d:d + 4 * G].contiguous().view(torch.float32)       # [T, G]
    return values * scale.repeat_interleave(group, dim=1)[:, :d]


def decode_rows_naive(rows: torch.Tensor, d: int, kind: str, group: int = GROUP) -> torch.Tensor:
    """Reference: every row, every group, one at a time, from the byte layout."""
    dtype, _ = KINDS[kind]
    out = torch.full((rows.shape[0], d), float("nan"))
    for t in range(rows.shape[0]):
        for gi, start in enumerate(range(0, d, group)):
            stop = min(d, start + group)
            scale = rows[t, d + 4 * gi: d + 4 * gi + 4].clone().view(torch.float32)[0]
            out[t, start:stop] = rows[t, start:stop].clone().view(dtype).float() * scale
    return out
