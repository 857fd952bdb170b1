from .patch import Fault

FAULT = Fault(
    name="route_op_product_tile_transposed",
    description="the fused router's product writes a register tile's outputs transposed: a full set of four "
                "tokens gets expert j's score of token q as token q's score of expert j",
    file="ouro/native/router.cpp", function="products",
    replace=[("for (int64_t q = 0; q < 4; ++q) s[(t + q) * E + e + j] = out[j * 4 + q];",
              "for (int64_t q = 0; q < 4; ++q) s[(t + q) * E + e + j] = out[q * 4 + j];  // FAULT: transposed")],
    localised=[{"op": "route", "module": r"layers\.\d+\.mlp\.gate"}],
    probes=[["numerics", "--model", "tiny", "--a", "fused=off,mode=decode", "--b", "fused=on,mode=decode"]],
    symptom="decoded text is wrong in the sparse layers at batch 4 and more; a single sequence decodes right",
)
