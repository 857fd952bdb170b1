from .patch import Fault

FAULT = Fault(
    name="index_select_op_relu_after_weight",
    description="the fused indexer applies the ReLU after the head weight (relu(w * q.k)), not to the "
                "score alone (w * relu(q.k)): negatively weighted heads stop counting against a pool",
    file="ouro/native/mla.cpp", function="index_select_decode",
    replace=[("acc[k] += wi[h + j] * std::max(dots[j * 4 + k] * sc, 0.f);",
              "acc[k] += std::max(wi[h + j] * dots[j * 4 + k] * sc, 0.f);  // FAULT: ReLU of the weighted score")],
    localised=[{"op": "index_select_decode", "layer": "dsa"}],
    probes=[["numerics", "--model", "tiny", "--a", "fused=off,mode=decode", "--b", "fused=on,mode=decode"]],
    symptom="long-context recall is worse in decode; prefill attends to the right tokens",
)
