"""The work one forward step *must* do (FLOPs, bytes), from the model's parameters and config.

This is what the roofline floor divides by the machine's rates. It counts what the step needs,
not what ouro's kernels happen to dispatch (e.g. the padded all-expert matmul of a decode step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

ROUTED = ("experts.gate_up_proj", "experts.down_proj")   # stacked routed-expert weights
# a quantised module (`ouro.quant`) keeps its weight as an int8 / e4m3 buffer (`qweight`,
# `<name>_q`) beside float32 scales (`weight_scale`, `<name>_scale`): weights all the same
LOW_PRECISION = (torch.int8, torch.float8_e4m3fn)
QUANT_SUFFIXES = (("qweight", "weight"), ("weight_scale", "weight"), ("_q", ""), ("_scale", ""))
SCALE = "#scale"     # a quantised weight's scales, named after it (no parameter name has a '#')


def weight_tensors(model) -> dict:
    """{name: tensor} of every weight a step reads: the parameters, and the quantised weights and
    their scales (buffers), each under the name of the float weight it replaced (so
    `...experts.gate_up_proj_q` counts as a routed expert, `...q_proj.qweight` as dense)."""
    out = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    quantised = {n.rpartition(".")[0] for n, b in buffers.items() if b.dtype in LOW_PRECISION}
    for n, b in buffers.items():
        owner, _, leaf = n.rpartition(".")
        if owner not in quantised:
            continue
        for suffix, base in QUANT_SUFFIXES:
            if leaf.endswith(suffix):
                stem = leaf[: -len(suffix)] + base if suffix.startswith("_") else base
                out[f"{owner}.{stem}" + ("" if b.dtype in LOW_PRECISION else SCALE)] = b
                break
    return out


@dataclass
class StepCost:
    flops: float
    weight_bytes: float
    cache_bytes: float
    parts: dict = field(default_factory=dict)   # the terms above, itemised

    activation_bytes: float = 0.0

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.cache_bytes + self.activation_bytes


def activation_traffic(c, T: int, rows: int, e: int) -> dict:
    """Bytes the element-wise parts of a step must read and write, each fused as far as ouro fuses
    it (`T` new tokens, `rows` logits rows, activations of `e` bytes, hidden D, n streams): per layer
    two RMSNorms (a row in, a row out) and two hyper-connection merges (n streams and the block's
    output in, n streams out; the next weights read the new streams while they are in cache), the
    first layer's block input (n streams in, a row out), per MoE layer the combine (the routed
    experts' weighted sum, made inside their op, and the shared expert's row in, a row out); the embedding rows written and copied into the n
    streams, and at the top the streams' mean and the final norm of the logits rows."""
    D, n, L = c.hidden_size, c.hc_mult, c.num_hidden_layers
    n_moe = sum(t == "sparse" for t in c.mlp_layer_types)
    return {"norms": float(T * L * 2 * 2 * D * e + rows * 2 * D * e),
            "mhc": float(T * L * 2 * (2 * n + 1) * D * e + T * (n + 1) * D * e),
            "moe_combine": float(T * n_moe * 3 * D * e),
            "embedding": float(T * D * e),                         # the rows looked up, written
            "streams": float(T * (n + 1) * D * e + rows * (n + 1) * D * e)}   # copied to n streams; their mean


def expected_distinct(n_experts: int, k: int, tokens: int) -> float:
    """Expected number of distinct experts that `tokens` tokens touch when each picks `k` of
    `n_experts` uniformly at random: E * (1 - (1 - k/E)^T). An idealisation (the real router is
    neither uniform nor independent); min(E, T*k) is the worst-case bound."""
    return n_experts * (1.0 - (1.0 - k / n_experts) ** tokens)


def attended_rows(config, context: int) -> int:
    """Latent rows a query with `context` visible tokens attends to: all of them while the complete
    pools fit in the top-k budget, else the kept pools plus the incomplete tail pool."""
    keep = config.index_topk // config.index_kpool
    if context // config.index_kpool <= keep:
        return context
    return keep * config.index_kpool + context % config.index_kpool


def step_cost(model, query_lens: list[int], start_pos: list[int], logits_rows: int | None = None) -> StepCost:
    """FLOPs and bytes of one forward over sequences that already have `start_pos[b]` tokens cached
    and get `query_lens[b]` new ones; `logits_rows` rows go through the head (default: one per
    sequence, as the engine asks for).

    FLOPs, per new token: 2 x every parameter it uses once (everything but the embedding, the head
    and the routed experts; norm, bias and conv vectors count 2 per element too: 0.13% of `small`),
    plus 2 x the parameters of `num_experts_per_tok` routed experts per MoE layer; 2 x the head per
    logits row; plus attention over the context: DSA 4*H*kv_lora_rank per attended latent row
    (absorbed scores and values), the indexer 2*Hi*d per visible pool once there are more pools
    than it keeps (else it keeps them all unscored), and KDA 6*H*dk*dv (read, update and query of
    the recurrent state). Element-wise work (norms, activations, mHC mixing, Sinkhorn, top-k) is
    not counted.

    Bytes: the element-wise parts' own reads and writes (`activation_traffic`); every parameter
    except the embedding and the routed experts, read once; the embedding
    rows looked up (one per new token, at most the vocabulary); per MoE layer the routed experts the
    step's tokens touch, by `expected_distinct`. Cache: each new token's paged row written
    (`ModelConfig.cache_bytes_per_token`); per sequence and DSA layer the latent rows its queries attend
    to (decode: `attended_rows`; a prefill chunk: its whole context, each row once), per indexer
    layer its fp32 pool keys when it scores them, and each new token's indexer key and gate read
    back once to compress its pool; the KDA state slot written, and read unless the sequence starts
    in this step.
    """
    c = model.config
    T = sum(query_lens)
    rows = len(query_lens) if logits_rows is None else logits_rows
    named = weight_tensors(model)
    size = lambda p: p.numel() * p.element_size()
    emb = model.embed_tokens.weight
    head = named.get("lm_head.weight", getattr(model.lm_head, "weight", None))   # (tied weights: one tensor)
    routed = {n: p for n, p in named.items() if n.endswith(ROUTED) or n.removesuffix(SCALE).endswith(ROUTED)}
    scales = {n for n in named if n.endswith(SCALE)}     # bytes, not products
    dense = {n: p for n, p in named.items() if n not in routed and p is not emb and p is not head}
    n_moe = sum(t == "sparse" for t in c.mlp_layer_types)
    E, k = c.n_routed_experts, c.num_experts_per_tok
    per_expert = sum(p.numel() for n, p in routed.items() if n not in scales) / max(1, n_moe * E)
    per_expert_low = sum(p.numel() for n, p in routed.items() if p.dtype in LOW_PRECISION) / max(1, n_moe * E)
    per_expert_bytes = sum(size(p) for p in routed.values()) / max(1, n_moe * E)

    flops = {"weights": 2.0 * T * sum(p.numel() for n, p in dense.items() if n not in scales),
             "routed_experts": 2.0 * T * n_moe * k * per_expert,
             "head": 2.0 * rows * head.numel(), "dsa": 0.0, "indexer": 0.0,
             "kda": 6.0 * T * len(c.kda_layers) * c.linear_num_heads * c.linear_head_dim ** 2}
    r, H = c.kv_lora_rank, c.num_attention_heads
    keep = c.index_topk // c.index_kpool
    for q, s in zip(query_lens, start_pos):
        for pos in range(s, s + q):        # the query at `pos` sees pos + 1 tokens
            flops["dsa"] += 4.0 * len(c.dsa_layers) * H * r * attended_rows(c, pos + 1)
            pools = (pos + 1) // c.index_kpool
            if pools > keep:
                flops["indexer"] += 2.0 * len(c.indexer_layers) * c.index_n_heads * c.index_head_dim * pools

    distinct = expected_distinct(E, k, T)
    weights = {"dense": float(sum(size(p) for p in dense.values()) + size(head)),
               "embedding_rows": float(min(T, c.vocab_size) * emb.shape[1] * emb.element_size()),
               "routed_experts": n_moe * distinct * per_expert_bytes}
    e = emb.element_size()   # the cache holds the model's dtype (pool keys: fp32)
    # each token's indexer key and gate are read back once, when its pool completes and is compressed
    pool_inputs = float(T * len(c.indexer_layers) * 2 * c.index_head_dim * e)
    cache = {"written": float(T * c.cache_bytes_per_token(emb.dtype)), "latent_read": 0.0,
             "pool_keys_read": 0.0, "pool_inputs_read": pool_inputs, "kda_state": 0.0}
    for q, s in zip(query_lens, start_pos):
        ctx = s + q
        cache["latent_read"] += len(c.dsa_layers) * r * e * (attended_rows(c, ctx) if q == 1 else ctx)
        if ctx // c.index_kpool > keep:
            cache["pool_keys_read"] += len(c.indexer_layers) * 4 * c.index_head_dim * (ctx // c.index_kpool)
        cache["kda_state"] += c.state_bytes_per_slot * (1 if s == 0 else 2)
    # the share of those FLOPs that are int8 / e4m3 products (a machine runs them at their own rate)
    low = 2.0 * T * (sum(p.numel() for p in dense.values() if p.dtype in LOW_PRECISION) + n_moe * k * per_expert_low)
    low += 2.0 * rows * head.numel() if head.dtype in LOW_PRECISION else 0.0
    acts = activation_traffic(c, T, rows, e)
    return StepCost(flops=sum(flops.values()), weight_bytes=sum(weights.values()), cache_bytes=sum(cache.values()),
                    activation_bytes=sum(acts.values()),
                    parts={"flops": flops, "weight_bytes": weights, "cache_bytes": cache, "activation_bytes": acts,
                           "distinct_experts_per_layer": distinct, "low_precision_flops": low})


def decode_cost(model, context: int, batch: int) -> StepCost:
    """A decode step: `batch` sequences, each adding its token number `context`."""
    return step_cost(model, [1] * batch, [context - 1] * batch)


def prefill_cost(model, tokens: int) -> StepCost:
    """Prefill of one fresh `tokens`-token prompt in one chunk, logits of the last token only."""
    return step_cost(model, [tokens], [0], logits_rows=1)
