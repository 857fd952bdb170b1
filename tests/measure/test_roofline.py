"""The roofline arithmetic on a model small enough to count by hand.

Every expected number below is written out from the config (D=4, V=10, ...) so that a change in
what `step_cost` counts, or in the model's parameters, shows up here.
"""

import itertools

import pytest
import torch

from ouro.bench.offline import decode_floor
from ouro.measure.roofline import Roofline, count_flops
from ouro.measure.step_cost import expected_distinct, prefill_cost
from ouro.config import ModelConfig
from ouro.models.glm5_next import Glm5NextModel

# layer 0: KDA + dense MLP, layer 1: DSA (own indexer) + MoE; hc_mult 4, conv kernel 4 (defaults)
CONFIG = ModelConfig(
    vocab_size=10, hidden_size=4, intermediate_size=6, moe_intermediate_size=3, num_hidden_layers=2,
    num_attention_heads=2, n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2, kv_lora_rank=5,
    q_lora_rank=3, qk_nope_head_dim=2, v_head_dim=3, index_topk=4, index_head_dim=2, index_n_heads=2,
    index_kpool=2, linear_head_dim=2, linear_num_heads=3, layer_types=("linear_attention", "indexed_attention"),
    mlp_layer_types=("dense", "sparse"), indexer_types=("full", "full"))

# parameters by hand (D=4, V=10)
EMBED = HEAD = 10 * 4
HC = 24 * 16 + 24 + 3             # fn [(2+4)*4, 4*4], base, scale
PER_LAYER = 4 + 4 + 2 * HC        # two RMSNorms, attn_hc and ffn_hc
# KDA, C = 3 heads * 2 = 6: q/k/v proj, convs, f_a, f_b, dt_bias, A_log, b_proj, g_a, g_b, o_norm, o_proj
KDA = 3 * 4 * 6 + 3 * 6 * 4 + 4 * 2 + 2 * 6 + 6 + 3 + 4 * 3 + 4 * 2 + 2 * 6 + 2 + 6 * 4
DENSE_MLP = 3 * 4 * 6
# DSA: q_a, q_a norm, q_b [3 -> 2*2], kv_a [4 -> 5], kv_a norm, kv_b [5 -> 2*(2+3)], o_proj [2*3 -> 4]
DSA = 4 * 3 + 3 + 3 * 2 * 2 + 4 * 5 + 5 + 5 * 2 * 5 + 2 * 3 * 4
# indexer: wq_b [3 -> 2*2], wk, k_norm (weight + bias), weights_proj, compress ape [2, 2], gate [2, 4]
INDEXER = 3 * 2 * 2 + 4 * 2 + 2 * 2 + 4 * 2 + 2 * 2 + 2 * 4
ROUTER, SHARED = 4 * 4, 3 * 4 * 3
EXPERT = 3 * 3 * 4                # gate, up, down of one routed expert (I=3, D=4)
DENSE_PARAMS = 4 + 2 * PER_LAYER + KDA + DENSE_MLP + DSA + INDEXER + ROUTER + SHARED   # 4: final norm
# element-wise traffic (`activation_traffic`, float32, n = 4 streams): per token two layers of two
# norms (row in and out) and two merges (4 streams + the block output in, 4 streams out), layer 0's
# block input (4 streams in, a row out), the MoE layer's combine (the routed experts' sum and the
# shared expert's row in, a row out), the embedding row written and copied into 4 streams; per logits row the
# streams' mean (4 in, 1 out) and the final norm
ACT_TOKEN = 4 * (2 * 2 * 2 * 4 + 2 * 2 * 9 * 4 + 5 * 4 + 3 * 4 + 4 + 5 * 4)
ACT_ROW = 4 * (2 * 4 + 5 * 4)
SLOT = 4 * (3 * 6 * 3 + 3 * 2 * 2)     # fp32 conv window [3C, K-1] + recurrent state [H, dk, dv]
TOKEN_ROW = 4 * (5 + 2 * 2) + 4 * 2 // 2   # latent + indexer key and gate, + fp32 pool key per kpool tokens
POOL_INPUTS = 4 * 2 * 2                    # a token's indexer key and gate, read back when its pool is compressed


@pytest.fixture(scope="module")
def model():
    with torch.device("meta"):    # shapes and dtypes only
        return Glm5NextModel(CONFIG)


def test_parameter_count_by_hand(model):
    assert sum(p.numel() for p in model.parameters()) == DENSE_PARAMS + EMBED + HEAD + 4 * EXPERT


def test_decode_floor_by_hand(model):
    B, L = 3, 7   # 3 sequences, each adding token number 7: 3 complete pools > 4/2 kept
    rows = 2 * 2 + 7 % 2   # two kept pools of 2 plus the tail token
    flops = (2 * B * DENSE_PARAMS          # every non-routed weight, once per token
             + 2 * B * 2 * EXPERT          # 2 routed experts per token, one MoE layer
             + 2 * B * HEAD                # one logits row per sequence
             + 4 * B * 2 * 5 * rows        # DSA: scores and values over 5-wide latents, 2 heads
             + 2 * B * 2 * 2 * 3           # indexer: 2 heads x d=2 over 3 pools
             + 6 * B * 3 * 2 * 2)          # KDA state: 3 heads of [2, 2]
    distinct = 4 * (1 - (1 - 2 / 4) ** B)  # expected experts 3 tokens touch: 3.5
    weight_bytes = 4 * (DENSE_PARAMS + HEAD) + 4 * B * 4 + 4 * distinct * EXPERT
    cache_bytes = (B * (TOKEN_ROW + POOL_INPUTS)   # each new token's row written, its key and gate read back
                   + 4 * B * rows * 5       # attended latent rows read
                   + 4 * B * 3 * 2          # fp32 pool keys scored
                   + 2 * B * SLOT)          # KDA state read and written
    for rates in ((1000.0, 1000.0), (1000.0, 100.0)):   # compute-bound, then memory-bound
        roof = Roofline(flops_per_s=rates[0], bytes_per_s=rates[1])
        f = decode_floor(model, roof, context=L, batch=B)
        assert f["flops"] == flops
        assert f["weight_bytes"] == pytest.approx(weight_bytes, rel=1e-12)
        assert f["cache_bytes"] == cache_bytes
        assert f["activation_bytes"] == B * (ACT_TOKEN + ACT_ROW)
        assert f["floor_s"] == pytest.approx(
            max(flops / rates[0], (weight_bytes + cache_bytes + B * (ACT_TOKEN + ACT_ROW)) / rates[1]), rel=1e-12)


def test_prefill_cost_by_hand(model):
    n = 7
    rows = 1 + 2 + 3 + 4 + 5 + (4 + 0) + (4 + 1)   # whole prefix while pools <= 2, then 2 pools + tail
    flops = (2 * n * DENSE_PARAMS + 2 * n * 2 * EXPERT + 2 * 1 * HEAD   # logits of the last token only
             + 4 * 2 * 5 * rows
             + 2 * 2 * 2 * (3 + 3)        # only the queries at 6 and 7 tokens score (3 pools each)
             + 6 * n * 3 * 2 * 2)
    weight_bytes = 4 * (DENSE_PARAMS + HEAD) + 4 * n * 4 + 4 * 4 * (1 - (1 - 2 / 4) ** n) * EXPERT
    cache_bytes = n * (TOKEN_ROW + POOL_INPUTS) + 4 * 7 * 5 + 4 * 3 * 2 + SLOT   # fresh: KDA state only written
    c = prefill_cost(model, n)
    assert c.flops == flops
    assert c.bytes == pytest.approx(weight_bytes + cache_bytes + n * ACT_TOKEN + 1 * ACT_ROW, rel=1e-12)


def test_expected_distinct_experts_by_enumeration():
    picks = list(itertools.combinations(range(4), 2))          # each token picks 2 of 4
    mean = sum(len(set(a) | set(b)) for a in picks for b in picks) / len(picks) ** 2
    assert expected_distinct(4, 2, 2) == pytest.approx(mean)   # 3.0


def test_floor_is_the_slower_of_compute_and_memory():
    roof = Roofline(flops_per_s=1e9, bytes_per_s=1e8)
    assert roof.floor_s(3e9, 2e8) == 3.0
    assert roof.floor_s(1e9, 5e8) == 5.0


def test_count_flops_of_a_plain_matmul():
    a, b = torch.randn(3, 5), torch.randn(5, 7)
    assert count_flops(lambda: a @ b) == 2 * 3 * 5 * 7
    assert count_flops(lambda: torch.bmm(a.expand(2, 3, 5), b.expand(2, 5, 7))) == 2 * 2 * 3 * 5 * 7


@pytest.mark.parametrize("method", ["w8a8", "fp8"])
def test_a_quantised_step_counts_its_low_precision_weights(method):
    """After W8A8 / FP8 the products are the same FLOPs, now at the low-precision rate; the bytes
    are one per quantised weight plus a float32 scale per output channel (an int8 weight is a
    buffer, not a parameter: a floor blind to buffers would drop every quantised product)."""
    from ouro.quant.w8a8 import W8A8Experts, W8A8Linear, quantize_model
    torch.manual_seed(0)
    model = Glm5NextModel(CONFIG)
    B, L = 3, 7
    roof = Roofline(flops_per_s=1000.0, bytes_per_s=1e9, low_flops_per_s=4000.0)
    before = decode_floor(model, roof, context=L, batch=B)
    assert before["low_precision_flops"] == 0
    quantize_model(model, method)
    lin = [m for m in model.modules() if isinstance(m, W8A8Linear)]
    exp = [m for m in model.modules() if isinstance(m, W8A8Experts)]
    assert lin and exp
    q_dense = sum(m.qweight.numel() for m in lin)
    scales_dense = sum(m.weight_scale.numel() for m in lin)
    q_expert = sum(m.gate_up_proj_q.numel() + m.down_proj_q.numel() for m in exp) / 4       # per expert
    s_expert = sum(m.gate_up_proj_scale.numel() + m.down_proj_scale.numel() for m in exp) / 4
    distinct = 4 * (1 - (1 - 2 / 4) ** B)
    after = decode_floor(model, roof, context=L, batch=B)
    assert after["flops"] == before["flops"]
    low = 2 * B * q_dense + 2 * B * 2 * q_expert
    assert after["low_precision_flops"] == low
    want_bytes = before["weight_bytes"] - 3 * q_dense + 4 * scales_dense - distinct * (3 * q_expert - 4 * s_expert)
    assert after["weight_bytes"] == pytest.approx(want_bytes, rel=1e-12)
    compute = (after["flops"] - low) / 1000.0 + low / 4000.0
    assert after["floor_s"] == pytest.approx(max(compute, (want_bytes + after["cache_bytes"]) / 1e9), rel=1e-12)


@pytest.mark.parametrize("quantised", [False, True])
def test_part_floors_split_the_step_floor_without_gaps_or_overlaps(quantised):
    """Every weight and attention term lands in exactly one part: at a rate where only compute
    counts, the parts' floors add up to the step's compute time, and likewise for memory."""
    from ouro.measure.step_breakdown import ROWS, part_floors
    from ouro.measure.step_cost import decode_cost
    from ouro.quant.w8a8 import quantize_model
    torch.manual_seed(0)
    model = Glm5NextModel(CONFIG)
    if quantised:
        quantize_model(model)
    cost = decode_cost(model, 7, 3)
    low = cost.parts["low_precision_flops"]
    compute = Roofline(flops_per_s=1000.0, bytes_per_s=1e30, low_flops_per_s=3000.0)
    floors = part_floors(model, 7, 3, compute)
    assert set(floors) <= set(ROWS) and floors["routed experts"] > 0 and floors["KDA"] > 0
    assert sum(floors.values()) == pytest.approx(compute.compute_s(cost.flops, low), rel=1e-9)
    memory = Roofline(flops_per_s=1e30, bytes_per_s=1000.0)
    assert sum(part_floors(model, 7, 3, memory).values()) == pytest.approx(cost.bytes / 1000.0, rel=1e-9)


@pytest.mark.parametrize("quantised", [False, True])
def test_prefill_part_floors_split_the_prefill_floor(quantised):
    """A prefill's parts: the head runs one row per sequence, every other weight every token; the
    parts add up to `step_cost` of the same prefill in compute and in memory."""
    from ouro.measure.step_breakdown import ROWS, step_part_floors
    from ouro.measure.step_cost import step_cost
    from ouro.quant.w8a8 import quantize_model
    torch.manual_seed(0)
    model = Glm5NextModel(CONFIG)
    if quantised:
        quantize_model(model)
    lens = [9, 5]
    cost = step_cost(model, lens, [0, 0])
    compute = Roofline(flops_per_s=1000.0, bytes_per_s=1e30, low_flops_per_s=3000.0)
    floors = step_part_floors(model, compute, lens, [0, 0])
    assert set(floors) <= set(ROWS) and floors["DSA without indexer"] > 0
    assert sum(floors.values()) == pytest.approx(compute.compute_s(cost.flops, cost.parts["low_precision_flops"]),
                                                 rel=1e-9)
    head = step_part_floors(model, compute, lens, [0, 0], logits_rows=14)["embedding + head"]
    assert head > floors["embedding + head"]          # 14 logits rows cost more than 2
    memory = Roofline(flops_per_s=1e30, bytes_per_s=1000.0)
    assert sum(step_part_floors(model, memory, lens, [0, 0]).values()) == pytest.approx(cost.bytes / 1000.0, rel=1e-9)
