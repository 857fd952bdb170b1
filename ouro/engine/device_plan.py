"""`ouro plan --tp N --cp N --device-memory ...`: what one long request costs per device, and how
many fit.

Per request at a context of L tokens:
- DSA latents and the indexer cache are per token (`ModelCache.bytes_per_token`). The MLA latent
  is shared by every head, so tensor parallelism replicates it. Under context parallelism a rank
  attends from its queries to every key before them, so the rank holding the prompt's end holds
  all of them: no saving per device either way.
- The KDA state (short-conv window and fp32 recurrent state, `ModelCache.bytes_per_slot`) is per
  head, so tensor parallelism splits it.

Per device:
- weights: the parameters in the weight dtype, split by tensor parallelism (norms and the router,
  which are replicated, are under 0.1% of them);
- the activation peak of one CP prefill chunk: the largest per-layer working set for the chunk's
  tokens on one rank. This is an estimate from the shapes, not a measurement:
  - the hyper-connection streams;
  - the routed experts' gate/up outputs;
  - KDA's chunked tensors;
  - the indexer's score block, bounded by `ouro.ops.dsa.indexer.SCORE_BUDGET`.

The same figures for a model whose every layer were MLA attention show the hybrid design's KV
saving as a ratio.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from .plan_report import sequence_bytes


def parse_bytes(text: str) -> int:
    """'141GB' / '80GiB' / '512MiB' / '1e9' -> bytes (decimal units for GB/MB, binary for GiB/MiB)."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*(|B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)\s*", str(text), re.IGNORECASE)
    if not m:
        raise ValueError(f"a memory size is a number with an optional unit (B, MB, GB, MiB, GiB, ...), got {text!r}")
    unit = m.group(2).lower()
    scale = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}[unit]
    return int(float(m.group(1)) * scale)


@dataclass
class DevicePlan:
    context: int
    tp: int
    cp: int
    weight_bytes: int            # per device
    latent_bytes: int            # per request: DSA latents + indexer cache (replicated across TP)
    kda_state_bytes: int         # per request, per device (split across TP)
    activation_bytes: int        # per device, one CP prefill chunk
    chunk_tokens: int            # tokens of that chunk on one rank
    device_bytes: int | None
    all_mla_latent_bytes: int    # per request if every layer were MLA attention
    split_share: float | None = None   # --cp-layer-split: a helper rank's share of the DSA rows (its block + a scratch layer)
    dsa_bytes_per_token: int = 0

    @property
    def request_bytes(self) -> int:
        return self.latent_bytes + self.kda_state_bytes

    @property
    def fits(self) -> int | None:
        if self.device_bytes is None:
            return None
        free = self.device_bytes - self.weight_bytes - self.activation_bytes
        return max(0, free // self.request_bytes)

    def longest_prompt(self, share: float = 1.0) -> int | None:
        """The longest prompt whose DSA rows (times `share`) and KDA state fit one device beside
        the weights and one chunk's activations."""
        if self.device_bytes is None:
            return None
        free = self.device_bytes - self.weight_bytes - self.activation_bytes - self.kda_state_bytes
        return max(0, int(free // max(1.0, self.dsa_bytes_per_token * share)))

    @property
    def kv_saving(self) -> float:
        return self.all_mla_latent_bytes / max(1, self.latent_bytes)


def activation_bytes(config: ModelConfig, tokens: int, tp: int, context: int, dtype=torch.bfloat16) -> int:
    """Largest per-layer working set of one prefill chunk of `tokens` on one rank (an estimate)."""
    from ..ops.dsa.indexer import SCORE_BUDGET
    c, e = config, torch.empty(0, dtype=dtype).element_size()
    streams = 3 * tokens * c.hc_mult * c.hidden_size * e + tokens * c.hc_mult * c.hidden_size * 4   # in, out, merge; fp32 mix
    experts = tokens * c.num_experts_per_tok * (2 * c.moe_intermediate_size + c.hidden_size) * e // tp
    kda = 12 * tokens * (c.linear_num_heads // tp) * c.linear_head_dim * 4          # q, k, v, g and their decayed forms, fp32
    indexer = 4 * min(SCORE_BUDGET, tokens * c.index_n_heads * max(1, context // c.index_kpool))
    return int(streams + max(experts, kda, indexer if c.indexer_layers else 0))


def layer_split_share(config: ModelConfig, cp: int, dtype=torch.bfloat16) -> float:
    """A LayerSplit helper rank's share of the DSA rows: its largest owned block plus one scratch
    layer as large as the largest layer (layers with an indexer cost more), over all layers."""
    from ..parallel.layer_split import owners
    per = [_layer_bytes(config, layer, dtype) for layer in config.dsa_layers]
    own = owners(len(per), cp)
    block = max(sum(b for b, r in zip(per, own) if r == rank) for rank in range(cp))
    return min(1.0, (block + max(per)) / sum(per))


def _layer_bytes(config: ModelConfig, layer: int, dtype) -> int:
    e, d = dtype.itemsize, config.index_head_dim
    own = e * d * 2 + 4 * d // config.index_kpool if layer in config.indexer_layers else 0
    return e * config.kv_lora_rank + own


def device_plan(config: ModelConfig, context: int, tp: int = 1, cp: int = 1, kv_dtype=torch.bfloat16,
                weight_dtype=torch.bfloat16, device_bytes: int | None = None, prefill_chunk: int = 8192,
                page_size: int = 64, ep: bool = False, layer_split: bool = False) -> DevicePlan:
    from ..parallel.tp_shard import rank_weight_bytes
    for name, v in (("tp", tp), ("cp", cp), ("context", context), ("prefill_chunk", prefill_chunk)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    # rank 0's weights as `--tp` shards them: split parts / tp plus everything replicated (refuses
    # a size that does not divide, naming the counts)
    weights = rank_weight_bytes(config, tp, ep, weight_dtype)
    seq = sequence_bytes(config, context, kv_dtype, page_size)
    ke = torch.empty(0, dtype=kv_dtype).element_size()
    all_mla = -(-context // page_size) * page_size * config.num_hidden_layers * config.kv_lora_rank * ke
    chunk = min(prefill_chunk, -(-context // cp))
    if layer_split and cp < 2:
        raise ValueError("--layer-split splits the DSA layers among CP ranks: give --cp 2 or more")
    return DevicePlan(context, tp, cp, weights, seq["paged_bytes"],
                      seq["state_bytes"] // tp, activation_bytes(config, chunk, tp, context, weight_dtype),
                      chunk, device_bytes, all_mla, layer_split_share(config, cp, kv_dtype) if layer_split else None,
                      config.cache_bytes_per_token(kv_dtype))


def format_device_plan(name: str, p: DevicePlan) -> str:
    g = lambda b: f"{b / 2**30:,.2f} GiB"
    lines = [f"{name} at {p.context:,} tokens, tp {p.tp} x cp {p.cp} ({p.tp * p.cp} devices), per device:",
             f"  weights             {g(p.weight_bytes)}",
             f"  per request         {g(p.request_bytes)} = DSA latents + indexer {g(p.latent_bytes)} "
             f"+ KDA state {g(p.kda_state_bytes)}",
             f"  prefill activations {g(p.activation_bytes)} (estimate: one CP chunk of {p.chunk_tokens:,} tokens per rank)",
             f"  all-MLA comparison  {g(p.all_mla_latent_bytes)} of latents per request if every layer were MLA: "
             f"the hybrid keeps {p.kv_saving:.1f}x less"]
    if p.fits is not None:
        lines.append(f"  fits                {p.fits} such requests on a {g(p.device_bytes)} device")
    if p.split_share is not None:
        lines.append(f"  layer split         a CP helper rank keeps {g(p.latent_bytes * p.split_share)} of DSA rows per "
                     f"request ({p.split_share:.0%}: its block of layers and one scratch layer); the engine rank, "
                     "which decodes, keeps them all")
        if p.device_bytes is not None:
            lines.append(f"  longest prompt      on a helper rank: {p.longest_prompt(p.split_share):,} tokens with the split, "
                         f"{p.longest_prompt():,} without")
    return "\n".join(lines)
