from ..fault_patch import Fault

FAULT = Fault(
    name="w8a8_activation_scale_shared",
    description="W8A8 quantises the whole batch's activations with one scale instead of one per token",
    file="ouro/quant/w8a8.py", function="w8a8_product",
    replace=[("return native().w8a8_packed(x.float(), p, weight_scale, _span(x.shape[0]), qweight.shape[0])",
              "s = x.float().abs().amax() / 127  # FAULT: one scale for every row\n"
              "        q = torch.round(x.float() / s).clamp(-127, 127).to(torch.int8)\n"
              "        return dequantize(int8_forms.int8_mm(q, qweight, form), s.expand(x.shape[0]), weight_scale)")],
    localised=[{"module": r"layers\.0\.", "file": "ouro/quant/w8a8.py"}, {"module": r"layers\.0\.self_attn\."}],
    probes=[["numerics", "--model", "tiny", "--a", "quant=w8a8", "--b", "quant=w8a8,batch=4"]],
    symptom="under --quantization w8a8 a request's answer changes with the requests batched beside it",
)
