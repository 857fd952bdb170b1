from .patch import Fault

FAULT = Fault(
    name="sparse_mla_op_sum_head_stride",
    description="the fused sparse MLA decode sums a head's softmax denominator over the tile's scores at "
                "stride nt (the rows in this tile) instead of TILE (the score buffer's row length): every "
                "head but the first divides by another head's sum",
    file="ouro/native/mla.cpp", function="sparse_mla_decode",
    replace=[("for (int64_t t = 0; t < nt; ++t) sum += s[h * TILE + t];",
              "for (int64_t t = 0; t < nt; ++t) sum += s[h * nt + t];  // FAULT: stride TILE")],
    localised=[{"op": "sparse_mla_decode", "layer": "dsa"}],
    probes=[["numerics", "--model", "tiny", "--a", "fused=off,mode=decode", "--b", "fused=on,mode=decode"]],
    symptom="decoded text goes wrong in the DSA layers once the context is longer than the top-k keeps",
)
