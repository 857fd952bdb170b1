from .patch import Fault

FAULT = Fault(
    name="vision_merger_clamp_dropped",
    description="the vision tower's patch merger runs its SwiGLU without the swiglu_limit clamp",
    file="ouro/layers/vision.py", function="PatchMerger.forward",
    replace=[("clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))",
              "clamped_swiglu(self.gate_proj(x), self.up_proj(x), float('inf')))  # FAULT")],
    localised=[{"module": r"visual\.merger"}, {"file": "ouro/layers/vision.py", "function": ["PatchMerger.forward"]}],
    probes=[["vision", "--model", "tiny-vl"]],
    symptom="answers about images are a little off; text-only prompts are unaffected",
)
