from .patch import Fault

FAULT = Fault(
    name="kv_row_scale_not_rewritten",
    description="a quantised KV-cache row's values are written but its scales are not: the row decodes with "
                "whatever scale its page held before (a previous owner's, or none)",
    file="ouro/layers/model_cache.py", function="QuantisedRows.__setitem__",
    replace=[("encoded = encode_rows(values.reshape(-1, self.d), self.kind).view(*values.shape[:-1], -1)",
              "encoded = encode_rows(values.reshape(-1, self.d), self.kind).view(*values.shape[:-1], -1)\n"
              "encoded = torch.cat([encoded[..., :self.d], self.flat[idx][..., self.d:]], -1)"
              "  # FAULT: the scale bytes are left as they were")],
    localised=[{"module": r"layers\.3\.self_attn"}, {"layer": 3}],
    probes=[["numerics", "--model", "tiny", "--a", "impl=ouro", "--b", "kv=fp8_e4m3"]],
    symptom="with --kv-cache-dtype fp8_e4m3 answers degrade (worse after pages are reused)",
)
