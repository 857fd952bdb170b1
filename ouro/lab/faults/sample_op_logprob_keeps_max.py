from .patch import Fault

FAULT = Fault(
    name="sample_op_logprob_keeps_max",
    description="the native sampler's logprob leaves out the row maximum it subtracted before the exponentials "
                "(x - log sum e^(x - max), not x - max - log sum e^(x - max)): every reported logprob is off by "
                "the row's largest logit, the picks themselves right",
    file="ouro/native/sample.cpp", function="pick_logprobs",
    replace=[("lpp[b] = std::isinf(m) ? nan : (x[id] - m) - std::log(row_exp_sum(x, V, m));",
              "lpp[b] = std::isinf(m) ? nan : x[id] - std::log(row_exp_sum(x, V, m));  // FAULT: max kept")],
    localised=[{"op": "pick_logprobs", "module": "sampler"}],
    probes=[["numerics", "--model", "tiny", "--a", "fused=off,mode=decode", "--b", "fused=on,mode=decode"]],
    symptom="greedy text is right, but the API's logprobs are too high (some above 0) on every token",
)
