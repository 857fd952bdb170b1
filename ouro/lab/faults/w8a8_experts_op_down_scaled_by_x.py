from .patch import Fault

# Planted in the native W8A8 routed-experts call (`int8_mm.cpp`), which W8A8Experts runs for host
# float32 rows when ouro's int8 kernel is the form: a copy-paste of gate_up's epilogue into down's.
FAULT = Fault(
    name="w8a8_experts_op_down_scaled_by_x",
    description="the fused W8A8 routed-experts op dequantises the down product with each row's input "
                "activation scale (x's) instead of the scale its SwiGLU output h was quantised with",
    file="ouro/quant/int8_mm.cpp", function="w8a8_experts",
    replace=[("Dequantise{S2, down_scale.data_ptr<float>(), y.data_ptr<float>(), D}",
              "Dequantise{S1 /* FAULT: x's scale, not h's */, down_scale.data_ptr<float>(), y.data_ptr<float>(), D}")],
    localised=[{"module": r"layers\.\d+\.mlp\.experts$"}],
    # against the naive reference modules, not fused=off: every fused op upstream (norms, KDA decode)
    # rounds differently from its eager code, and W8A8 turns a 1e-7 change into an int8 step (the
    # first divergence of fused=off vs fused=on under quant=w8a8 is layer 0's o_proj, clean code)
    probes=[["numerics", "--model", "tiny", "--a", "quant=w8a8_ref,mode=decode", "--b", "quant=w8a8,mode=decode"]],
    # the op runs where the native int8 form is picked, a choice timed per machine (and provisional
    # while the machine is busy): pinned, so the planted line is on the path wherever the suite runs
    env={"OURO_INT8_FORM": "native"},
    symptom="--quantization w8a8 decodes wrong text in the MoE layers only while OURO_FUSED=0 (or the eager "
            "reference) is right",
)
