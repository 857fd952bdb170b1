from .patch import Fault

FAULT = Fault(
    name="indexer_twice_in_decode",
    description="DSA decode runs the lightning indexer twice on the same inputs",
    file="ouro/layers/dsa.py", function="DSAttention._forward",
    replace=[("selection = self.indexer(x, q_resid, ctx)", """selection = self.indexer(x, q_resid, ctx)
              if ctx.is_decode:   # FAULT: a second, identical selection
                  selection = self.indexer(x, q_resid, ctx)""")],
    localised=[{"file": "ouro/layers/dsa.py", "function": ["_forward", "forward"]},
               {"module": r"layers\.\d+\.self_attn\.indexer.*", "layer": "dsa"}],
    probes=[["redundancy", "--model", "tiny"]],
    symptom="decode is slower than its roofline says, outputs unchanged",
)
