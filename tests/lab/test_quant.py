"""The lab on W8A8: `quant=w8a8` against its naive reference agrees exactly on clean ouro, a batch
of others changes nothing, the unquantised comparison uses the int8 column and stays clean on the
trained model, and the three planted W8A8 faults are detected and localised in process, whichever
int8 product forms the machine picks (each form that runs here, and a VNNI CPU's mix)."""

from __future__ import annotations

import os

import pytest

from ouro.lab.faults.patch import applied_in_process
from ouro.lab.faults.scoring import localises
from ouro.lab.faults import all_faults
from ouro.lab.numerics.probe import probe_numerics
from ouro.lab.numerics.run_configs import parse_config
from ouro.lab.numerics.tolerances import column

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAULTS = {f.name: f for f in all_faults()}


W8A8_FAULTS = ["w8a8_activation_scale_shared", "w8a8_weight_scale_per_tensor", "w8a8_expert_scales_shifted"]


def _form_sets():
    """The int8 forms each product may take on some machine: this one's pick, each form that runs
    here for every row count, and a VNNI CPU's (ouro's kernel at one row, `torch._int_mm` from 16)."""
    from ouro.quant import int8_forms
    forms = int8_forms.available_forms()
    mixed = [("native",) + ("int_mm",) * (len(int8_forms.ROWS) - 1)] if {"native", "int_mm"} <= set(forms) else []
    return [None] + [(f,) * len(int8_forms.ROWS) for f in forms] + mixed


def _worst(findings):
    order = ["info", "warning", "error"]
    return max((order.index(f.severity) for f in findings), default=0)


@pytest.mark.parametrize("forms", _form_sets(), ids=lambda f: "picked" if f is None else "-".join(f))
@pytest.mark.parametrize("a, b", [("quant=w8a8_ref", "quant=w8a8"), ("quant=w8a8", "quant=w8a8,batch=4")])
def test_clean_w8a8_agrees_with_its_reference_and_alone(a, b, forms, monkeypatch):
    from ouro.quant import int8_forms
    if forms is not None:
        monkeypatch.setattr(int8_forms, "pick_forms", lambda device="cpu", timer=None, kind="product": list(forms))
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


@pytest.mark.parametrize("forms", _form_sets(), ids=lambda f: "picked" if f is None else "-".join(f))
@pytest.mark.parametrize("name", W8A8_FAULTS)
def test_planted_w8a8_faults_are_found_where_they_are_whatever_the_forms(name, forms, monkeypatch):
    """Which form a product takes depends on the machine and the row count: a fault planted in one
    form's branch would exist on some machines only (`w8a8_activation_scale_shared` was in the native
    branch alone and was found a layer late where `int_mm` runs the prefill's projections)."""
    from ouro.quant import int8_forms
    if forms is not None:
        monkeypatch.setattr(int8_forms, "pick_forms", lambda device="cpu", timer=None, kind="product": list(forms))
    fault = FAULTS[name]
    probe = fault.probes[0]
    a, b = probe[probe.index("--a") + 1], probe[probe.index("--b") + 1]
    with applied_in_process(fault, REPO):
        findings = probe_numerics("tiny", a, b, prompt_len=24)
    top = findings[0]
    assert top.severity == "error", top.summary
    assert localises(top, fault.localised, set()), top.where


def _with_outliers(tmp_path, layer: int):
    """tiny-py with one layer made sensitive to int8: its attention input's feature 0 is scaled to
    almost nothing by the layer norm, and the projections reading it carry a huge weight there. In
    float32 the pair nearly cancels; per-channel int8 makes that weight each row's scale and rounds
    the rest of the row to zero."""
    import shutil

    from safetensors.torch import load_file, save_file
    from ouro.models.resolve import resolve_model
    d = tmp_path / "outliers"
    shutil.copytree(resolve_model("tiny-py"), d)
    tensors = load_file(str(d / "model.safetensors"))
    prefix = f"model.language_model.layers.{layer}."
    tensors[prefix + "input_layernorm.weight"][0] = 1e-6
    for name in ("q_proj", "k_proj", "v_proj", "g_a_proj", "f_a_proj"):
        w = tensors[f"{prefix}self_attn.{name}.weight"]
        w[:, 0] = 300 * w.abs().max()
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


@pytest.mark.slow       # the per-layer measurements it searches over are tested by default above
def test_the_policy_search_keeps_layers_until_the_budget_holds(tmp_path):
    """A layer made sensitive to int8 (outlier columns) breaks a 0.1% budget: the search keeps that
    layer unquantised first and stops once the measured policy is within the budget."""
    from ouro.lab.quant_policy import search
    policy = search(str(_with_outliers(tmp_path, 2)), budget=0.001, max_bytes=6000, context_len=256)
    assert policy.all_quantised > policy.baseline * 1.001, policy.format()
    assert 2 in policy.kept_layers, policy.format()
    assert min(policy.per_layer, key=policy.per_layer.get) == 2
    assert policy.chosen <= policy.baseline * 1.001
    assert "layers.2.*" in policy.flags and policy.flags.startswith("--quantization w8a8 --quantization-ignore 'lm_head,")
    with pytest.raises(ValueError, match="budget must be >= 0"):
        search("tiny", budget=-0.1)


def test_numerics_names_the_layer_that_breaks_under_int8(tmp_path):
    findings = probe_numerics(str(_with_outliers(tmp_path, 2)), "impl=ouro", "quant=w8a8", prompt_len=48)
    top = findings[0]
    assert top.severity in ("warning", "error"), top.summary
    assert top.where.get("layer") == 2 or "layers.2." in str(top.where.get("module")), top.where


def test_the_kv_policy_space_keeps_layers_through_the_per_layer_flag():
    """`--target kv`: the same search over DSA layers; a kept layer is `--kv-cache-layer-dtype N:auto`,
    which the engine reads as that layer's rows in the engine dtype."""
    from ouro.config import EngineConfig, ModelConfig
    from ouro.lab.quant_policy import _space, search
    from ouro.models.resolve import resolve_model
    directory = str(resolve_model("tiny-py"))
    layers, options, flags = _space("kv", "int8", directory)
    assert layers == ModelConfig.from_hf(directory).dsa_layers == [3]
    assert flags([3]) == "--kv-cache-dtype int8 --kv-cache-layer-dtype '3:auto'" and flags([]) == "--kv-cache-dtype int8"
    mc = ModelConfig.from_hf(directory)
    assert EngineConfig(**options([3])).kv_kinds(mc) == {} and EngineConfig(**options([])).kv_kinds(mc) == {3: "int8"}
    policy = search("tiny-py", budget=0.01, max_bytes=6000, context_len=256, target="kv", kv_kind="fp8_e4m3")
    assert set(policy.per_layer) == {3} and policy.chosen <= policy.baseline * 1.01
    assert policy.flags.startswith("--kv-cache-dtype fp8_e4m3")
