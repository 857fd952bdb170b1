"""The lab sees inside the fused native ops: a planted fault in a kernel's C++ source is patched
into a copy of the package (its own build), and `numerics --a fused=off --b fused=on` finds it and
names the op or the module that ran it."""

import tempfile
from pathlib import Path

import pytest

from ouro.lab.numerics import sampler_taps
from ouro.lab.faults.patch import Fault, FaultDoesNotApply, applied_in_process, find_cpp_function, patch_source
from ouro.lab.faults.suite import run_fault
from ouro.lab.faults import all_faults
from ouro.lab.numerics.fused_taps import FUSED_OPS
from ouro.lab.numerics.probe import compare, make_prompt
from ouro.lab.numerics.run_configs import parse_config, run_config
from ouro.models.resolve import resolve_model

CPP = """// a comment naming route(x) is not it
int helper(int a);
std::tuple<int, int> route(const int& x,
                           int y) {
    if (x) { return {x, y}; }
    int z = helper(y);   // a call is not a definition
    return {z, 1};
}
struct S {
    void token(int t) const {
        int v = t * 2;
    }
};
"""

NATIVE_FAULTS = [f for f in all_faults() if f.file.endswith((".cpp", ".h"))]   # a kernel or a header it includes


def test_a_cpp_function_is_found_by_its_definition_and_braces():
    a, b = find_cpp_function(CPP, "route")
    assert CPP[a:].startswith("std::tuple<int, int> route(") and CPP[:b].endswith("return {z, 1};\n}")
    a, b = find_cpp_function(CPP, "token")
    assert "int v = t * 2;" in CPP[a:b] and CPP[:b].endswith("}") and "struct" not in CPP[a:b]
    assert find_cpp_function(CPP, "helper") is None      # declared, never defined here


def test_a_cpp_fault_patches_its_function_only_and_exactly_once():
    fault = Fault("f", "d", "x.cpp", "route", [("return {z, 1};", "return {z, 2};  // FAULT")], [{}], [[]])
    patched = patch_source(CPP, fault)
    assert "return {z, 2};  // FAULT" in patched and patched.count("FAULT") == 1
    twice = Fault("f", "d", "x.cpp", "route", [("return", "return")], [{}], [[]])
    with pytest.raises(FaultDoesNotApply, match="exactly once"):
        patch_source(CPP, twice)
    gone = Fault("f", "d", "x.cpp", "no_such", [("a", "b")], [{}], [[]])
    with pytest.raises(FaultDoesNotApply, match="not in"):
        patch_source(CPP, gone)
    with pytest.raises(FaultDoesNotApply, match="patched copy"):
        with applied_in_process(NATIVE_FAULTS[0], "."):
            pass


def test_fused_is_a_numerics_configuration_key():
    assert parse_config("fused=on").fused == "on" and parse_config("").fused == "watched"
    with pytest.raises(ValueError, match="fused"):
        parse_config("fused=maybe")


def test_every_fused_op_has_a_planted_fault_that_names_it():
    named = {spec.get("op") for f in NATIVE_FAULTS for spec in f.localised}
    ops = {op for _, op, _, _ in FUSED_OPS} | {sampler_taps.OP}     # the sampler's pick runs after the model
    assert ops - {"hc_post"} <= named       # hc_post is hc_post_pre's first half (`Mix::token`), one fault for both
    # every C++ source of the package (the fused families and the int8 kernel) has a planted fault,
    # but the product forms gemm_pick offers (gemv, panels, oneDNN's packed product through `packed_linear`):
    # each is checked against a float64 product before it is offered, so a wrong one is refused with
    # a warning and never runs (planted ones were: tests/machine/test_gemm_pick.py)
    checked_at_selection = {"ouro/native/gemv.cpp", "ouro/native/panels.cpp", "ouro/native/onednn.cpp"}
    sources = {p.as_posix() for p in Path("ouro").rglob("*.cpp")}
    assert sources - checked_at_selection <= {f.file for f in NATIVE_FAULTS} <= sources | {
        p.as_posix() for p in Path("ouro").rglob("*.h")}


def test_the_fused_ops_are_compared_where_the_eager_path_records_their_work():
    """fused=on against fused=off: every fused op's rows are compared with the eager code's (under the
    module, method or op key that did the work there) and agree; each row knows the op that made it."""
    model_dir = resolve_model("tiny", progress=False)
    prompt = make_prompt(model_dir, 48, 0)
    ra, rb = (run_config(model_dir, parse_config(c), prompt) for c in ("fused=off,mode=decode", "fused=on,mode=decode"))
    rows = {r["key"]: r for r in compare(ra, rb, "float32")}
    seen = {}
    for key, at in rb.fused_at.items():
        assert key in rows, f"{key} ({set(at.values())}) is recorded by the fused run only: nothing compares it"
        assert not rows[key]["diverges"], (key, rows[key]["worst"])
        for op in at.values():
            seen.setdefault(op, set()).add(key)
    # gated_rms_norm: KDA's output norm where the layer runs eagerly (deterministic inference,
    # speculative replay, CP); here both prefill and decode take the fused KDA ops
    assert set(seen) == {op for _, op, _, _ in FUSED_OPS} - {"gated_rms_norm"} | {sampler_taps.OP}, set(seen)
    # the sampler's rows: every probed pick, the free one at the end (a real logprob) among them
    assert seen[sampler_taps.OP] == {sampler_taps.KEY} and rows[sampler_taps.KEY]["kind"] == "sampler"
    assert len(rows[sampler_taps.KEY]["positions"]) > 1 and rb.stacked(sampler_taps.KEY)[1].min() < -0.1
    assert seen["hc_post_pre"] >= {"layers.0.attn_hc.mix", "layers.0.ffn_hc", "layers.0.ffn_hc.comb", "layers.1.attn_hc"}
    assert seen["sparse_mla_decode"] == {"layers.3.self_attn.attention_core"}
    assert "layers.0.self_attn.o_norm" in seen["kda_decode"] & seen["kda_prefill"]   # decode / prefill rows


def _check(name):
    fault = next(f for f in NATIVE_FAULTS if f.name == name)
    row = run_fault(fault, tempfile.mkdtemp(), 600)
    assert not row["errors"], row["errors"]
    assert row["detected"] and row["localised"], row["top"]
    return row


@pytest.mark.processes
def test_a_fault_inside_the_kda_kernel_is_found_and_named():
    row = _check("kda_decode_rate_not_exp")
    assert row["top"]["where"]["op"] in ("kda_decode", "kda_prefill")


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.parametrize("name", [f.name for f in NATIVE_FAULTS if f.name != "kda_decode_rate_not_exp"])
def test_every_native_fault_is_found(name):
    _check(name)
