"""LayerSplit (`--cp N --cp-layer-split`): under a context-parallel prefill each rank keeps the
DSA cache of its own layers only.

Ownership (`owners`): the DSA layers in N contiguous blocks, block r to CP rank r. A helper rank's
cache (`ModelCache(keep_dsa=...)`) stores its own layers' rows (latent, and the indexer's keys,
gates and pooled keys when the layer has its own indexer); every other DSA layer's storage is one
shared scratch layer, which holds the one remote layer in use.

A prompt prefilled over several CP forwards (`--cp-chunk-size`) needs, at each layer, the rows of
the chunks before: as layer l starts (`begin`), its owner broadcasts rows [0, start) of that layer.
The indexer's parts go first and are waited for (the indexer reads them at once); the latent rows
go as an async broadcast (gloo runs it on its own thread) that overlaps the layer's projections and
indexer, and are waited for just before attention (`attend`). They arrive in a NaN-filled buffer:
a broadcast that delivered nothing (a disabled communicator) raises `LayerSplitError` naming the
layer and its owner instead of attending over stale rows. When the scratch is taken for a layer,
its rows are invalidated (NaN) first, so a rank that reads it before the layer's rows landed reads
NaN, never the previous layer's rows; it records the layer it holds (`holds`) once they have.

The engine rank (the last) decodes from its own pool afterwards, so it keeps every layer
(`full`): it owns and broadcasts its block like any rank, and drops what it receives for the
others (it holds those rows already). The memory saved is the helper ranks': L / N + 1 layers of
DSA rows instead of L. New rows of the chunk itself still reach every rank by the all-gather
(`CPForwardContext.write_rows`), into the owner's cache or the scratch.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..measure import spans


class LayerSplitError(RuntimeError):
    """A layer's rows did not arrive: the prefill must not go on over stale or unwritten rows."""


def owners(n_layers: int, world: int) -> list[int]:
    """The CP rank owning each DSA cache index: contiguous blocks, the first ranks one larger."""
    base, extra = divmod(n_layers, world)
    out = []
    for r in range(world):
        out += [r] * (base + (r < extra))
    return out


def owned(n_layers: int, world: int, rank: int) -> set[int]:
    return {li for li, r in enumerate(owners(n_layers, world)) if r == rank}


class LayerSplit:
    """One rank's side of the broadcasts, for one CP forward (`CPForwardContext.split`)."""

    def __init__(self, config, group, rank: int, world: int, full: bool = False):
        self.config, self.group, self.rank, self.full = config, group, rank, full
        self.owner = owners(len(config.dsa_layers), world)
        self.holds: int | None = None            # the DSA layer the scratch holds
        self.pending = None
        self.stats = {"broadcasts": 0, "bytes": 0, "total_s": 0.0, "exposed_s": 0.0}

    def _rows(self, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """(cache rows of every sequence's tokens [0, start), cache rows of its complete pools there)."""
        if "_split_rows" not in ctx.__dict__:
            ps, kp = ctx.cache.page_size, self.config.index_kpool
            rows, pools = [], []
            for b, s in enumerate(self.cached(ctx)):
                t = torch.arange(s, device=ctx.page_table.device)
                rows.append(ctx.page_table[b, t // ps] * ps + t % ps)
                f = torch.arange(s // kp, device=t.device) * kp
                pools.append((ctx.page_table[b, f // ps] * ps + f % ps) // kp)
            ctx.__dict__["_split_rows"] = (torch.cat(rows), torch.cat(pools))
        return ctx.__dict__["_split_rows"]

    @staticmethod
    def cached(ctx) -> list[int]:
        """Each sequence's tokens cached before this forward: where the first rank's slice starts
        (this rank's own `start_pos` is where its slice starts)."""
        return list(ctx.peers[0].start_pos)

    def _mine(self, li: int) -> bool:
        return self.owner[li] == self.rank

    def _broadcast(self, flat, rows, li: int, what: str, async_op: bool = False):
        """Rows `rows` of `flat` from layer li's owner to every rank; returns (buffer, work)."""
        if self._mine(li):
            buf = flat[rows].contiguous()
        else:
            buf = torch.full((rows.numel(), flat.shape[-1]), float("nan"), dtype=flat.dtype, device=flat.device)
        src = dist.get_global_rank(self.group, self.owner[li])
        work = dist.broadcast(buf, src, group=self.group, async_op=async_op)
        self.stats["broadcasts"] += 1
        self.stats["bytes"] += buf.numel() * buf.element_size()
        return buf, work

    def _land(self, flat, rows, buf, li: int, what: str) -> None:
        """Check and store what arrived (the owner and the full rank keep their own rows)."""
        if self._mine(li):
            return
        if torch.isnan(buf).any():
            raise LayerSplitError(f"DSA layer {self.config.dsa_layers[li]} ({what}): the broadcast from CP rank "
                                  f"{self.owner[li]} delivered nothing to rank {self.rank} (rows still NaN): "
                                  "the communicator did not run")
        if not self.full:
            flat[rows] = buf

    def begin(self, layer, ctx) -> None:
        li = layer.cache_index
        if not any(self.cached(ctx)):              # nothing cached before this forward: nothing to send
            self.holds = li
            return
        rows, pools = self._rows(ctx)
        cache = ctx.cache
        if layer.indexer is not None:             # the indexer reads these first: sent and waited for now
            ci, d = layer.indexer.cache_index, self.config.index_head_dim
            for what, flat, idx in (("indexer keys", cache.key_rows(ci), rows),
                                    ("indexer gates", cache.index_gates[ci].view(-1, d), rows),
                                    ("pooled keys", cache.index_pooled[ci].view(-1, d), pools)):
                buf, _ = self._broadcast(flat, idx, li, what)
                self._land(flat, idx, buf, li, what)
        if not self._mine(li) and not self.full:   # the scratch now stands for this layer: what it held is invalid
            cache.latent_rows(li)[rows] = float("nan")
            self.holds = None
        buf, work = self._broadcast(cache.latent_rows(li), rows, li, "latent", async_op=True)
        self.pending = (li, buf, work, time.perf_counter())

    def attend(self, layer, ctx) -> None:
        li = layer.cache_index
        if self.pending is None or self.pending[0] != li:
            return
        _, buf, work, t0 = self.pending
        self.pending = None
        t_wait = time.perf_counter()
        work.wait()
        t1 = time.perf_counter()
        self.stats["total_s"] += t1 - t0
        self.stats["exposed_s"] += t1 - t_wait
        if spans.enabled():
            spans.record("layer split broadcast", "comm", int(t0 * 1e9), int(t1 * 1e9), tid=spans.lane("layer split"))
            spans.record("layer split wait", "comm", int(t_wait * 1e9), int(t1 * 1e9))
        self._land(ctx.cache.latent_rows(li), self._rows(ctx)[0], buf, li, "latent")
        self.holds = li


def share_state(cache, slot: int, group, src_rank: int) -> None:
    """The KDA state of `slot` (conv window and recurrent state, every KDA layer) from CP rank
    `src_rank` to every rank's own `slot`: a chunk's end state is the next chunk's start on all."""
    src = dist.get_global_rank(group, src_rank)
    for store in (cache.conv, cache.recurrent):
        buf = store[:, slot].contiguous()
        dist.broadcast(buf, src, group=group)
        store[:, slot] = buf


def chunk_bounds(n: int, chunk: int, world: int) -> list[tuple[int, int]]:
    """[start, end) of each CP forward of an n-token prompt (chunk 0: one forward); a last piece
    shorter than `world` tokens joins the one before."""
    if chunk <= 0 or chunk >= n:
        return [(0, n)]
    cuts = list(range(0, n, chunk)) + [n]
    if cuts[-1] - cuts[-2] < world and len(cuts) > 2:
        del cuts[-2]
    return list(zip(cuts, cuts[1:]))
