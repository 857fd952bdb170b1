from .patch import Fault

FAULT = Fault(
    name="hc_mix_comb_not_transposed",
    description="the hyper-connection mix sums the streams with comb, not its transpose (stream j -> i swapped)",
    file="ouro/layers/mhc.py", function="HyperConnection.mix",
    replace=[("comb.to(dt).transpose(-1, -2) @ streams", "comb.to(dt) @ streams  # FAULT: comb^T")],
    localised=[{"op": "mix", "layer": 0}, {"file": "ouro/layers/mhc.py", "function": ["mix"]}],
    probes=[["numerics", "--model", "tiny-py", "--a", "impl=transformers", "--b", "impl=ouro"]],
    symptom="the trained model's text is a little worse; every ouro configuration agrees with every other",
)
