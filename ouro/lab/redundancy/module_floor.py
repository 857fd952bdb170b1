"""What each block of the model must read and compute in one decode step (its floor), against what
the recorded ops did. The per-block split of `ouro.measure.step_cost`: weights read once (routed
experts: only the ones the batch's tokens touch), the cache rows attention reads (DSA: the
attended latent rows and the pool keys the indexer scores; KDA: the state slot read and written),
plus the block's own inputs and outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...measure.step_cost import ROUTED, attended_rows, expected_distinct
from ...layers.context import ModelCache
from .op_record import GATHER_LIKE, SCATTER_LIKE

SELECT_PASSES = 16   # int64/fp32 passes over a query's pools that selection and addressing make


def block_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "layers" and len(parts) >= 3:
        return ".".join(parts[:3])
    return parts[0]


@dataclass
class BlockCost:
    flops: float = 0.0           # matmul-like FLOPs
    bytes: float = 0.0
    core_bytes: float = 0.0      # bytes of the kind of work the floor counts (`core`)
    ops: int = 0
    top_bytes: object = None     # OpRecord with the most bytes
    top_flops: object = None     # OpRecord with the most matmul FLOPs
    top_core: object = None      # the `core` OpRecord with the most bytes
    modules: set = field(default_factory=set)


def core(op) -> bool:
    """Does the op do the kind of work a floor counts: read weights (or tensors computed from them
    alone: a cast or copy of a weight), a matmul, or a gather / scatter of rows (the caches)? The
    element-wise chains over activations in between are not: eager PyTorch makes 2-8 passes where a
    fused kernel makes one, more with the batch (the ops-per-step finding and fusion's business)."""
    return op.weights or op.matmul_flops > 0 or op.op in GATHER_LIKE or op.op in SCATTER_LIKE


def recorded_by_block(ops) -> dict[str, BlockCost]:
    out: dict[str, BlockCost] = {}
    for o in ops:
        if not o.compute:
            continue
        b = out.setdefault(block_of(o.module), BlockCost())
        b.flops += o.matmul_flops
        b.bytes += o.bytes
        if core(o):
            b.core_bytes += o.bytes
            if b.top_core is None or o.bytes > b.top_core.bytes:
                b.top_core = o
        b.ops += 1
        b.modules.add(o.module)
        if b.top_bytes is None or o.bytes > b.top_bytes.bytes:
            b.top_bytes = o
        if o.matmul_flops and (b.top_flops is None or o.matmul_flops > b.top_flops.matmul_flops):
            b.top_flops = o
    return out


def weight_floors(model, batch: int) -> dict[str, float]:
    """{parameter name: bytes} a decode step of `batch` sequences must read of it: the whole
    weight once; of the stacked routed experts, the experts the batch's tokens touch (expected
    under uniform routing); of the embedding, its `batch` rows (and the whole matrix once more
    when the head is tied to it)."""
    c = model.config
    emb, head = model.embed_tokens.weight, model.lm_head.weight
    distinct = expected_distinct(c.n_routed_experts, c.num_experts_per_tok, batch)
    out: dict[str, float] = {}
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if p is emb:
            out[name] = batch * emb.shape[1] * emb.element_size() + (nbytes if head is emb else 0.0)
        elif name.endswith(ROUTED):
            out[name] = distinct * p[0].numel() * p.element_size()
        else:
            out[name] = nbytes
    return out


def weight_reads(model, ops, batch: int) -> dict[str, tuple[float, float, object]]:
    """{parameter name: (bytes the recorded ops read of it, its floor, the op that read most of it)}
    for the weight matrices (and stacked experts) read at all. Vectors (norms, biases, scales) are
    left out: element-wise ops read them as they read activations, a few passes each (the eager
    chains `core` leaves out too). A oneDNN packed copy (`gemm_pick.packed_for`) read by an op
    counts as the weight it was packed from (`OpRecord.weight_reads`)."""
    names = {}
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            names.setdefault(p.untyped_storage().data_ptr(), name)
    floors = weight_floors(model, batch)
    read: dict[str, list] = {}
    for o in ops:
        for storage, nbytes in o.weight_reads:
            name = names.get(storage)
            if name is None:           # a vector or a buffer
                continue
            r = read.setdefault(name, [0.0, None, 0.0])
            r[0] += nbytes
            if nbytes > r[2]:
                r[1], r[2] = o, nbytes
    return {n: (r[0], floors[n], r[1]) for n, r in read.items()}


def block_floors(model, context: int, batch: int, io_bytes: dict[str, float]) -> dict[str, tuple[float, float]]:
    """{block: (matmul FLOPs, bytes)} a decode step of `batch` sequences at `context` must do."""
    c = model.config
    emb, head = model.embed_tokens.weight, model.lm_head.weight
    e = emb.element_size()
    distinct = expected_distinct(c.n_routed_experts, c.num_experts_per_tok, batch)
    keep = c.index_topk // c.index_kpool
    pools = context // c.index_kpool
    floors: dict[str, list[float]] = {}
    for name, p in model.named_parameters():
        blk = block_of(name.rsplit(".", 1)[0]) if "." in name else name
        f = floors.setdefault(blk, [0.0, 0.0])
        if p is emb and p is not head:
            f[1] += batch * emb.shape[1] * e
            continue
        if name.endswith(ROUTED):
            f[0] += 2.0 * batch * c.num_experts_per_tok * p[0].numel()
            f[1] += distinct * p[0].numel() * p.element_size()
            continue
        f[0] += 2.0 * batch * p.numel() if p.dim() >= 2 else 0.0
        f[1] += p.numel() * p.element_size()
    if head is emb:   # tied: the head reads the whole matrix
        floors.setdefault("lm_head", [0.0, 0.0])[1] += head.numel() * head.element_size()
    per_slot_layer = ModelCache.bytes_per_slot(c) / max(1, len(c.kda_layers))
    for i, kind in enumerate(c.layer_types):
        f = floors.setdefault(f"layers.{i}.self_attn", [0.0, 0.0])
        if kind == "linear_attention":
            f[0] += 6.0 * batch * c.linear_num_heads * c.linear_head_dim ** 2
            f[1] += 2 * batch * per_slot_layer
            continue
        rows = attended_rows(c, context)
        f[0] += 4.0 * batch * c.num_attention_heads * c.kv_lora_rank * rows
        f[1] += batch * c.kv_lora_rank * e * (rows + 1)
        if c.indexer_types[i] == "full":
            f[0] += 2.0 * batch * c.index_n_heads * c.index_head_dim * pools if pools > keep else 0.0
            f[1] += batch * 4 * c.index_head_dim * pools + 2 * batch * c.index_head_dim * e * 2
            if pools > keep:   # scoring writes and reads [Hi, P] scores; the top-k and the pools' cache
                # addresses take a few int64 passes over [P]
                f[1] += batch * pools * (4 * 2 * c.index_n_heads + 8 * SELECT_PASSES)
    for blk, f in floors.items():
        f[1] += io_bytes.get(blk, 0.0)
    return {k: (v[0], v[1]) for k, v in floors.items()}
