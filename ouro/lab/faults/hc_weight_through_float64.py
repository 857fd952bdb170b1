from .patch import Fault

FAULT = Fault(
    name="hc_weight_through_float64",
    description="the hyper-connection copies its projection weight to float64 on every call (cast back inside hc_weights)",
    file="ouro/layers/mhc.py", function="HyperConnection.forward",
    replace=[("return hc_pre(streams, self.fn, self.base, self.scale, self.norm_eps, self.hc_eps, self.iters)",
              "return hc_pre(streams, self.fn.double(), self.base, self.scale, self.norm_eps, self.hc_eps, "
              "self.iters)  # FAULT: fn copied to float64"),
             # the fused path (the redundancy probe's passive hooks keep it on) copies it there and back
             ("return fused.hc_pre(streams, *self._weights())",
              "return fused.hc_pre(streams, self.fn.double().float(), *self._weights()[1:])  # FAULT: fn via float64")],
    localised=[{"file": "ouro/layers/mhc.py", "function": ["forward"], "module": r"layers\.\d+\.(attn_hc|ffn_hc)"}],
    probes=[["redundancy", "--model", "tiny"]],
    symptom="decode is a little slower than its roofline says, outputs unchanged",
)
