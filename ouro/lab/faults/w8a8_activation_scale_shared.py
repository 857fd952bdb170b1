from .patch import Fault

# Planted where every product form passes (before the form decides how the product runs): a fault
# planted in one form's branch exists only on the machines that pick that form for a layer's row
# count. It was in the `native` branch alone: where `int_mm` wins at 16 and 128 rows (a VNNI CPU),
# the projections' prefill products ran without it and only the experts' few-row products (native)
# carried it, so the probe found it a layer late, at layers.1.mlp.experts.
FAULT = Fault(
    name="w8a8_activation_scale_shared",
    description="W8A8 quantises the whole batch's activations with one scale instead of one per token "
                "(in every int8 product form)",
    file="ouro/quant/w8a8.py", function="w8a8_product",
    replace=[("form = _form(forms, x.shape[0])",
              "form = _form(forms, x.shape[0])\n"
              "if qweight.dtype == torch.int8:   # FAULT: one scale for every row, whichever form runs the product\n"
              "    s = x.float().abs().amax() / 127\n"
              "    q = torch.round(x.float() / s).clamp(-127, 127).to(torch.int8)\n"
              "    return dequantize(int8_forms.int8_mm(q, qweight, form), s.expand(x.shape[0]), weight_scale)")],
    localised=[{"module": r"layers\.0\.", "file": "ouro/quant/w8a8.py"}, {"module": r"layers\.0\.self_attn\."}],
    probes=[["numerics", "--model", "tiny", "--a", "quant=w8a8", "--b", "quant=w8a8,batch=4"]],
    symptom="under --quantization w8a8 a request's answer changes with the requests batched beside it",
)
