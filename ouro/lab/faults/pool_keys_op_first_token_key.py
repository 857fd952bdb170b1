from .patch import Fault

FAULT = Fault(
    name="pool_keys_op_first_token_key",
    description="the fused pool-key op weighs the pool's first token's key for every token (k[0] for k[j]): "
                "each pool's compressed key is its first token's",
    file="ouro/native/mla.cpp", function="pool_keys_write",
    replace=[("for (int64_t c = 0; c < d; ++c) o[c] += x[j * d + c] / sum[c] * k[j][c];",
              "for (int64_t c = 0; c < d; ++c) o[c] += x[j * d + c] / sum[c] * k[0][c];  // FAULT: first key")],
    localised=[{"op": "pool_keys_write", "layer": "dsa"}],
    probes=[["numerics", "--model", "tiny", "--a", "fused=off,mode=decode", "--b", "fused=on,mode=decode"]],
    symptom="long-context recall drifts: the indexer picks pools by the wrong keys; short prompts are fine",
)
