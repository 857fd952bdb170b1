"""The lab on W8A8: `quant=w8a8` against its naive reference agrees exactly on clean ouro, a batch
of others changes nothing, the unquantised comparison uses the int8 column and stays clean on the
trained model, and the two planted W8A8 faults are detected and localised in process."""

from __future__ import annotations

import os

import pytest

from ouro.lab.fault_patch import applied_in_process
from ouro.lab.fault_scoring import localises
from ouro.lab.faults import all_faults
from ouro.lab.numerics import probe_numerics
from ouro.lab.run_configs import parse_config
from ouro.lab.tolerances import column

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAULTS = {f.name: f for f in all_faults()}


def _worst(findings):
    order = ["info", "warning", "error"]
    return max((order.index(f.severity) for f in findings), default=0)


@pytest.mark.parametrize("a, b", [("quant=w8a8_ref", "quant=w8a8"), ("quant=w8a8", "quant=w8a8,batch=4")])
def test_clean_w8a8_agrees_with_its_reference_and_alone(a, b):
    findings = probe_numerics("tiny", a, b, prompt_len=24)
    assert _worst(findings) == 0, [f.summary for f in findings]


def test_quantised_against_float_uses_the_int8_column_and_is_clean_on_tiny_py():
    assert column("float32", "float32", "none", "w8a8") == "int8"
    assert column("float32", "float32", "w8a8_ref", "w8a8") == "float32"
    findings = probe_numerics("tiny-py", "impl=ouro", "quant=w8a8", prompt_len=48)
    assert _worst(findings) == 0, [f.summary for f in findings]
    with pytest.raises(ValueError, match="applies to impl=ouro only"):
        parse_config("impl=transformers,quant=w8a8")
    with pytest.raises(ValueError, match="must be one of"):
        parse_config("quant=w4")


@pytest.mark.parametrize("name", ["w8a8_activation_scale_shared", "w8a8_weight_scale_per_tensor"])
def test_planted_w8a8_faults_are_found_where_they_are(name):
    fault = FAULTS[name]
    probe = fault.probes[0]
    a, b = probe[probe.index("--a") + 1], probe[probe.index("--b") + 1]
    with applied_in_process(fault, REPO):
        findings = probe_numerics("tiny", a, b, prompt_len=24)
    top = findings[0]
    assert top.severity == "error", top.summary
    assert localises(top, fault.localised, set()), top.where
