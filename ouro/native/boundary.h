// The float32 boundary of a fused op. The kernels compute in float32; a bfloat16 model's activations
// (a decode step's few rows) and small weights are converted once at the op's entry and its results
// back to the activation's dtype at exit, so a bfloat16 model runs the same kernels as a float32 one.
// Large weights are not converted: the routed experts read bfloat16 rows directly (`Lanes::load`).
// Intermediates stay float32 where the eager bfloat16 path rounds between ops, so a fused bfloat16
// result differs from the eager one by bfloat16 rounding and is the nearer of the two to float32's.
#pragma once
#include <ATen/core/Tensor.h>

namespace ouro {

inline at::Tensor f32(const at::Tensor& t) { return t.scalar_type() == at::kFloat ? t : t.to(at::kFloat); }

inline at::Tensor as_dtype(const at::Tensor& t, at::ScalarType dt) { return t.scalar_type() == dt ? t : t.to(dt); }

}  // namespace ouro
