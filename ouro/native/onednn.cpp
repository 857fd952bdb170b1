// oneDNN's packed product `x [M, K] @ w [N, K].T` as a native op a compiled graph calls directly.
//
// `ouro.machine.gemm_pick`'s "packed" form runs `mkldnn::_linear_pointwise` on a copy of the weight in
// oneDNN's blocked layout, an opaque tensor a graph cannot hold. Before this op the graph reached that
// product through `ouro::opaque_call`, back into Python for every projection: ~47-55 us a call (cold,
// after a step's weights streamed through the caches), 35 calls in a float32 decode step of `small` at
// batch 16 (AMD EPYC Zen 4). Here the graph holds the plain weight; the op keeps the packed copy of
// each weight it meets, keyed by the weight's storage (held weakly: a freed weight's copy is dropped
// on the next insert) and remade when the weight's version moves (an in-place update outside
// inference mode; `weight_cache.h`). Python's eager path takes its packed copies from the same cache
// (`packed_weight`), so a weight has one.
//
// Rows are padded as `gemm_pick.row_bucket` pads them (exact to 16 rows, then one of 8 steps per power
// of two: oneDNN builds a kernel per new row count), so the op gives the eager packed form's bits.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "weight_cache.h"

namespace {

constexpr int64_t EXACT_ROWS = 16;

int64_t row_bucket(int64_t rows) {
    if (rows <= EXACT_ROWS) return rows;
    int64_t bits = 0;
    for (int64_t r = rows; r > 0; r >>= 1) ++bits;
    const int64_t step = int64_t(1) << std::max<int64_t>(0, bits - 4);
    return (rows + step - 1) / step * step;
}

ouro::WeightCache cache;      // weight -> its packed copy (`weight_cache.h`)

at::Tensor reorder(const at::Tensor& w) {
    static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_reorder_linear_weight", "");
    torch::jit::Stack stack{w, c10::IValue()};
    op.callBoxed(&stack);
    return stack.back().toTensor();
}

// the packed copy of `w` (2-D), made on first use and again after an in-place change
at::Tensor packed_weight(const at::Tensor& w) {
    TORCH_CHECK(w.dim() == 2, "packed_weight: the weight must be 2-D [N, K]");
    return cache.get(w, reorder);
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& w) {
    TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
                "packed_linear: x must be [M, K] and w [N, K] (K ", w.size(1), ")");
    TORCH_CHECK(x.scalar_type() == w.scalar_type(), "packed_linear: x and w must share a dtype");
    static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    const at::Tensor packed = packed_weight(w);
    const int64_t rows = x.size(0), padded = row_bucket(rows);
    at::Tensor in = x.contiguous();
    if (padded != rows) {
        at::Tensor p = at::zeros({padded, x.size(1)}, x.options());
        p.narrow(0, 0, rows).copy_(in);
        in = p;
    }
    torch::jit::Stack stack{in, packed, c10::IValue(), std::string("none"), c10::List<std::optional<at::Scalar>>(),
                            std::string("")};
    op.callBoxed(&stack);
    at::Tensor y = stack.back().toTensor();
    return padded != rows ? y.narrow(0, 0, rows) : y;
}

int64_t packed_cache_size() { return cache.size(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(ouro_native, m) {
    m.def("packed_linear(Tensor x, Tensor w) -> Tensor");
    m.def("packed_weight(Tensor w) -> Tensor", &packed_weight);
    m.def("packed_cache_size() -> int", &packed_cache_size);
}

TORCH_LIBRARY_IMPL(ouro_native, CPU, m) {
    m.impl("packed_linear", &packed_linear);
}
