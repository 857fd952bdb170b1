from .patch import Fault

FAULT = Fault(
    name="host_sync_in_moe",
    description="the MoE layer checks its expert ids with int(tensor) on every step: a host sync per layer",
    file="ouro/layers/moe.py", function="MoE.forward",
    replace=[("weights, experts = self.gate(x)", """weights, experts = self.gate(x)
              if int(experts.max()) >= self.experts.gate_up_proj.shape[0]:   # FAULT: host sync
                  raise IndexError("expert id out of range")""")],
    localised=[{"file": "ouro/layers/moe.py", "function": ["forward"]}],
    probes=[["redundancy", "--model", "tiny"]],
    symptom="the decode step cannot be captured in a CUDA graph; GPU utilisation has gaps",
)
