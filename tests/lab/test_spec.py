"""The lab's `spec=nextn:K` numerics configuration: the decode tokens run through speculative
verification (forced drafts with every step's last one wrong, so each step rolls one position
back); clean, every logit agrees with the plain decode; the two planted speculation faults are
each found at the first KDA layer. And the draft work speculation throws away (`spec_waste`): what
clean speculation costs is info, drafts departing from the draft layer's own are a warning."""

from __future__ import annotations

import os

import pytest

from ouro.engine.sampling import SamplingParams
from ouro.lab.faults.patch import applied_in_process
from ouro.lab.faults.scoring import localises
from ouro.lab.faults import all_faults
from ouro.lab.numerics.probe import probe_numerics
from ouro.lab.numerics.run_configs import parse_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAULTS = {f.name: f for f in all_faults()}
A, B = "mode=decode,decode=12", "mode=decode,decode=12,spec=nextn:3"


def test_speculation_agrees_with_plain_decode_in_the_lab():
    findings = probe_numerics("tiny-py", A, B, prompt_len=40)
    assert all(f.severity == "info" for f in findings), [f.summary for f in findings]
    with pytest.raises(ValueError, match="must be off or nextn:K"):
        parse_config("spec=eagle")
    assert parse_config("spec=nextn:2").spec_steps == 2


@pytest.mark.parametrize("name", ["spec_conv_window_not_rolled_back", "spec_state_committed_one_too_far"])
def test_planted_speculation_faults_are_found_where_they_are(name):
    fault = FAULTS[name]
    with applied_in_process(fault, REPO):
        findings = probe_numerics("tiny-py", A, B, prompt_len=40)
    top = findings[0]
    assert top.severity == "error", top.summary
    assert localises(top, fault.localised, set()), top.where


def test_thrown_away_draft_work_is_a_redundancy_finding():
    """Clean speculation throws many drafts away (the trained tiny-py's MTP head is often wrong):
    that is what it costs, an info finding, since the draft layer driven from scratch on the same
    tokens gets exactly as many accepted on the same verifications."""
    from ouro.lab.redundancy.spec_waste import spec_waste_finding
    f = spec_waste_finding("tiny-py", k=4, n_prompts=2, prompt_len=48, output_len=16)
    assert f.where["function"] == "Speculator.draft" and f.where["file"] == "ouro/engine/speculative.py"
    rates = f.evidence["accept_rate_per_position"]
    assert len(rates) == 4 and all(0 <= a <= 1 for a in rates)
    assert 0 < f.measured["reject_share"] < 1 and f.measured["wasted_us"] > 0
    assert f.evidence["drafts_rejected"] == round(f.measured["reject_share"] * f.evidence["drafts_verified"])
    weak = [i + 1 for i, a in enumerate(rates) if a < 0.5]
    assert ("--speculative-num-steps" in f.next) == bool(weak)
    assert f.severity == "info", f.summary
    assert f.evidence["drafts_accepted"] == f.evidence["reference_accepted"] > 0, f.evidence


def test_drafts_departing_from_the_draft_layer_are_a_warning_at_the_drafting():
    """The planted fault feeds the draft layer token p beside the trunk's state at p: outputs stay
    right (verification rejects the drafts), acceptance collapses against the reference's."""
    from ouro.lab.redundancy.spec_waste import spec_waste_finding
    fault = FAULTS["spec_draft_rows_one_token_behind"]
    with applied_in_process(fault, REPO):
        f = spec_waste_finding("tiny-py", k=3, n_prompts=2, prompt_len=48, output_len=16)
    assert f.severity == "warning", f.summary
    assert localises(f, fault.localised, set()), f.where
    assert f.evidence["drafts_accepted"] < f.evidence["reference_accepted"] / 2, f.evidence
    assert f.where["positions"][0] >= 48            # a decode position of a 48-token prompt


def test_reference_drafts_follow_the_draft_layer_chain():
    """The reference stops at the first draft that misses the tokens, never past the drafts asked for."""
    from ouro.engine.llm import LLM
    from ouro.lab.redundancy.spec_waste import _accepted, reference_drafts
    llm = LLM("tiny-py", max_memory=128 << 20, page_size=16, speculative_config={"num_speculative_tokens": 3})
    ids = llm.generate({"prompt_token_ids": list(range(5, 40))},
                       SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    ids = list(ids.prompt_token_ids) + list(ids.token_ids)
    checks = [(n, 3) for n in range(36, len(ids) - 3)]
    ref = reference_drafts(llm.engine.model, llm.engine.speculator.layer, ids, checks)
    for n, d in checks:
        a = _accepted(ref[n], ids, n)
        assert 1 <= len(ref[n]) <= d and len(ref[n]) == min(d, a + 1), (n, ref[n], a)
