from .patch import Fault

FAULT = Fault(
    name="hc_head_reads_first_stream",
    description="the final collapse of the hyper-connection streams reads the first stream only (as a model "
                "without mHC) instead of the mean of the hc_mult streams",
    file="ouro/layers/mhc.py", function="HyperHead.forward",
    replace=[("return streams.mean(1)", "return streams[:, 0]  # FAULT: the first stream, not the mean")],
    localised=[{"module": r"hc_head$", "file": "ouro/layers/mhc.py"}],
    probes=[["numerics", "--model", "tiny-py", "--a", "impl=transformers", "--b", "impl=ouro"]],
    symptom="the trained model's text is worse everywhere; every ouro configuration agrees with every other",
)
