from .patch import Fault

FAULT = Fault(
    name="layer_split_stale_scratch",
    description="under LayerSplit a helper rank checks the broadcast latent rows but attends over what its "
                "scratch layer held before (the previous remote layer's rows)",
    file="ouro/parallel/layer_split.py", function="LayerSplit._land",
    replace=[("flat[rows] = buf", "flat[rows] = buf if what != \"latent\" else flat[rows]  # FAULT")],
    localised=[{"op": "sparse_mla"}, {"file": "ouro/parallel/layer_split.py", "function": ["LayerSplit._land"]}],
    probes=[["numerics", "--model", "small", "--prompt-len", "96", "--a", "cp=2,chunk=32", "--b", "cp=2,chunk=32,split=on"]],
    symptom="long prompts prefilled with --cp-layer-split answer differently from --cp alone; no error is raised",
)
