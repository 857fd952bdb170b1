"""`ouro probe numerics --kcp-sweep`: tf32 is flagged far above fp32 and located in the chain;
fp32 and tf32x3 stay at float32's level; a chain that ignores its configured precision is an error
naming the product it runs through."""

import ouro.ops.kda.cp as cp
from ouro.lab.numerics.kcp_precision import sweep, sweep_findings
from ouro.models.presets import PRESETS


def run(contexts=(512, 1024), slice_len=128):
    return sweep_findings(sweep(PRESETS["tiny"], contexts, slice_len), slice_len)


def test_tf32_flagged_and_the_exact_modes_are_not():
    findings = run()
    warnings = [f for f in findings if f.severity == "warning"]
    assert len(warnings) == 1 and "in tf32" in warnings[0].summary, [f.summary for f in findings]
    assert warnings[0].where == {"file": "ouro/ops/kda/cp.py", "function": "chain_states"}
    assert warnings[0].measured["error"] > 100 * warnings[0].measured["fp32_error"]
    assert not [f for f in findings if f.severity == "error"]
    info = [f for f in findings if f.severity == "info"][0]
    assert "fp32" in info.evidence["final-state error by context"]


def test_products_ignoring_the_configured_precision_are_an_error(monkeypatch):
    monkeypatch.setattr(cp, "_mm", lambda precision: (lambda a, b: cp.matmul(a, b, "tf32")))
    findings = run()
    assert findings[0].severity == "error" and "configured fp32" in findings[0].summary
    assert findings[0].where["function"] == "_mm"
