"""The lab's `spec=nextn:K` numerics configuration: the decode tokens run through speculative
verification (forced drafts with every step's last one wrong, so each step rolls one position
back); clean, every logit agrees with the plain decode; the two planted speculation faults are
each found at the first KDA layer."""

from __future__ import annotations

import os

import pytest

from ouro.lab.fault_patch import applied_in_process
from ouro.lab.fault_scoring import localises
from ouro.lab.faults import all_faults
from ouro.lab.numerics import probe_numerics
from ouro.lab.run_configs import parse_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    from ouro.lab.spec_waste import spec_waste_finding
    f = spec_waste_finding("tiny-py", k=4, n_prompts=2, prompt_len=48, output_len=16)
    assert f.where["function"] == "Speculator.draft" and f.where["file"] == "ouro/engine/speculative.py"
    rates = f.evidence["accept_rate_per_position"]
    assert len(rates) == 4 and all(0 <= a <= 1 for a in rates)
    assert 0 < f.measured["reject_share"] < 1 and f.measured["wasted_us"] > 0
    assert f.evidence["drafts_rejected"] == round(f.measured["reject_share"] * f.evidence["drafts_verified"])
    weak = [i + 1 for i, a in enumerate(rates) if a < 0.5]
    assert ("--speculative-num-steps" in f.next) == bool(weak)
