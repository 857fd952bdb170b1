from ..fault_patch import Fault

# Planted before the form is chosen: the routed experts' int8 products run in ouro's kernel (all
# experts in one call) or expert by expert through `w8a8_product`, whichever this machine measured
# faster for the rows an expert gets, and the fault must be the same bug on every machine.
FAULT = Fault(
    name="w8a8_expert_scales_shifted",
    description="the W8A8 routed experts' product applies expert e-1's per-channel weight scales to expert e's "
                "rows (in every int8 product form)",
    file="ouro/quant/w8a8.py", function="w8a8_grouped",
    replace=[("rows = max(1, x.shape[0] // max(1, int((counts > 0).sum())))",
              "rows = max(1, x.shape[0] // max(1, int((counts > 0).sum())))\n"
              "weight_scales = weight_scales.roll(1, 0)   # FAULT: each expert gets its neighbour's scales")],
    localised=[{"module": r"layers\.1\.mlp\.experts"}],
    probes=[["numerics", "--model", "tiny", "--a", "quant=w8a8_ref", "--b", "quant=w8a8"]],
    symptom="--quantization w8a8 loses far more accuracy than int8 should, in the MoE layers only",
)
