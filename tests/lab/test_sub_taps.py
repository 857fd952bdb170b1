"""numerics against transformers compares the sub-computations ouro computes in a method or an op
(`ouro/lab/numerics/sub_taps.py`): clean ouro agrees on every one of them, and the planted faults there are
found at the sub-computation itself, not at the next module both models share."""

import os

import pytest

from ouro.lab.faults.patch import applied_in_process
from ouro.lab.faults.scoring import score
from ouro.lab.faults import all_faults
from ouro.lab.numerics.probe import compare, findings_from, make_prompt, ouro_names
from ouro.lab.numerics.run_configs import parse_config, run_config
from ouro.models.resolve import resolve_model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL, N = "tiny-py", 48     # 12 index pools: its DSA layer (index_topk 32) attends sparsely past 32 tokens
A, B = parse_config("impl=transformers"), parse_config("impl=ouro")
FAULTS = {f.name: f for f in all_faults()}
# fault -> the key the first divergent finding must name
NAMED = {"kda_forget_gate_rate_not_exp": "layers.0.self_attn.forget_gate",
         "hc_mix_comb_not_transposed": "layers.0.ffn_hc.mix",   # layer 0's streams start equal: comb^T = comb there
         "sinkhorn_rows_by_column_sums": "layers.0.attn_hc.comb",
         "sparse_mla_unused_slots_unmasked": "layers.3.self_attn.attention_core",
         "hc_head_reads_first_stream": "hc_head",                    # transformers' module hc_head (was: at norm)
         "mlp_swiglu_gate_up_swapped": "layers.0.mlp.clamped_swiglu",   # the input of down_proj (was: down_proj)
         # the absorbed kv_b_proj: its output made from ouro's W_uk | W_uv (was: attention_core, sparse_mla)
         "mla_absorb_rows_part_major": "layers.3.self_attn.kv_b_proj"}


@pytest.fixture(scope="module")
def runs():
    """A clean ouro run and the transformers run (faults patch ouro only: one reference serves all)."""
    model_dir = resolve_model(MODEL, progress=False)
    prompt = make_prompt(model_dir, N, 0)
    ours = run_config(model_dir, B, prompt)
    return model_dir, prompt, ours, run_config(model_dir, A, prompt, names=ouro_names(ours))


def _findings(ref, ours):
    return findings_from(ref, ours, "float32", dict(model=MODEL, a=A, b=B, prompt_len=N, seed=0, device="cpu", n=N))


def test_every_sub_computation_is_compared_and_clean_ouro_agrees(runs):
    _, _, ours, ref = runs
    rows = {r["key"]: r for r in compare(ref, ours, "float32")}
    want = [f"layers.{i}.{k}" for i in range(4) for k in
            ("attn_hc.post", "attn_hc.comb", "attn_hc.mix", "self_attn.attention_core", "ffn_hc.comb", "ffn_hc.mix")]
    want += [f"layers.{i}.self_attn.{k}" for i in range(3) for k in ("forget_gate", "causal_conv1d", "f_a_proj", "f_b_proj")]
    want += ["hc_head", "layers.0.mlp.clamped_swiglu", "layers.3.self_attn.kv_b_proj"] + [f"layers.{i}.mlp.shared_experts.clamped_swiglu" for i in (1, 2, 3)]
    missing = [k for k in want if k not in rows]
    assert not missing, missing
    assert not [k for k, r in rows.items() if r["diverges"]]
    assert [f.severity for f in _findings(ref, ours)] == ["info"]


@pytest.mark.parametrize("name", sorted(NAMED))
def test_fault_found_at_its_sub_computation(runs, name):
    model_dir, prompt, _, ref = runs
    fault = FAULTS[name]
    assert fault.probes == [["numerics", "--model", MODEL, "--a", str(A), "--b", str(B)]]
    with applied_in_process(fault, REPO):
        ours = run_config(model_dir, B, prompt)
    found = _findings(ref, ours)
    s = score(found, fault.localised, {3})
    assert s["detected"] and s["localised"], s["top"]
    assert f"first divergence at {NAMED[name]} " in s["top"]["summary"], s["top"]["summary"]


def test_pool_keys_stand_on_their_last_tokens_rows_and_a_neighbours_pools_are_left_out():
    """`pools_by_token`: each pool's key on the row of its last token; a pool a context-parallel rank
    computes for a neighbour (its last token not among this rank's rows) is not written anywhere
    (it once landed on row 0: cp=1 against cp=2 diverged there in a clean run)."""
    from types import SimpleNamespace

    import torch

    from ouro.lab.numerics.sub_taps import pools_by_token
    ctx = SimpleNamespace(seq_index=torch.tensor([0, 0, 0, 0, 1, 1]), positions=torch.tensor([4, 5, 6, 7, 2, 3]))
    seqs, ends = torch.tensor([0, 1, 0]), torch.tensor([7, 3, 11])      # the third ends on another rank
    pooled = torch.arange(1.0, 7.0).view(3, 2)
    out = pools_by_token(seqs, ends, pooled, ctx)
    want = torch.zeros(6, 2)
    want[3], want[5] = pooled[0], pooled[1]
    assert torch.equal(out, want)
