from .patch import Fault

FAULT = Fault(
    name="w8a8_weight_scale_per_tensor",
    description="W8A8 quantises each projection's weight with one scale per tensor instead of one per output channel",
    file="ouro/quant/w8a8.py", function="W8A8Linear.from_linear",
    replace=[("q, s = QUANTIZERS[method](linear.weight.detach())",
              "w = linear.weight.detach()  # FAULT: one scale for the whole tensor\n"
              "        s = (w.abs().amax() / 127).expand(w.shape[0]).contiguous()\n"
              "        q = torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8)")],
    localised=[{"module": r"layers\.0\.", "file": "ouro/quant/w8a8.py"}, {"module": r"layers\.0\.self_attn\."}],
    probes=[["numerics", "--model", "tiny", "--a", "quant=w8a8_ref", "--b", "quant=w8a8"]],
    symptom="--quantization w8a8 loses more accuracy than int8 should (small output channels flattened)",
)
