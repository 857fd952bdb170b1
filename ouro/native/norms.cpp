// Fused norms and activations for the decode step: RMSNorm of a row (one pass for the sum of
// squares, one for the scaled write), the sigmoid-gated RMSNorm of KDA's output and the clamped
// SwiGLU of a gate / up pair. Each replaces 4-6 torch ops (and their temporaries) with one call;
// rows run in parallel only when a thread's share is worth waking it.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "boundary.h"
#include "vec.h"

namespace {

constexpr int64_t GRAIN_ELEMENTS = 1 << 15;   // ~128 KB of float32 per thread at least
// a sigmoid an element (~0.6 cycles at 512 bits): a thread's 8k elements are worth waking it for
constexpr int64_t SIGMOID_GRAIN_ELEMENTS = 1 << 13;

int64_t grain(int64_t width, int64_t elements = GRAIN_ELEMENTS) {
    return std::max<int64_t>(1, elements / std::max<int64_t>(1, width));
}

void check_rows(const at::Tensor& t, const char* what) {
    TORCH_CHECK(t.scalar_type() == at::kFloat, what, " must be float32, got ", t.scalar_type());
    TORCH_CHECK(t.dim() >= 1 && t.stride(-1) == 1, what, " must have a contiguous last dimension");
}

// y = weight * (x * rsqrt(mean(x^2) + eps)), row by row over the last dimension. A 2-D x whose rows
// sit apart (a slice of a merged product's output: MLA's q_a and kv_a halves) is read in place.
at::Tensor rms_norm_f32(const at::Tensor& x_in, const at::Tensor& weight, double eps) {
    check_rows(x_in, "x");
    check_rows(weight, "weight");
    const bool apart = x_in.dim() == 2 && x_in.size(0) > 1 && x_in.stride(0) >= x_in.size(1);
    at::Tensor x = apart ? x_in : x_in.contiguous();
    const int64_t D = x.size(-1), rows = D ? x.numel() / D : 0, xs = apart ? x.stride(0) : D;
    TORCH_CHECK(weight.numel() == D, "weight has ", weight.numel(), " entries for rows of ", D);
    at::Tensor y = at::empty(x.sizes(), x.options());
    const float* xp = x.data_ptr<float>();
    const float* wp = weight.contiguous().data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const float e = static_cast<float>(eps);
    at::parallel_for(0, rows, grain(D), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
            const float* row = xp + r * xs;
            const float inv = 1.f / std::sqrt(ouro::sumsq(row, D) / static_cast<float>(D) + e);
            ouro::scale_mul(yp + r * D, row, inv, wp, D);
        }
    });
    return y;
}

// weight * (x * rsqrt(mean(x^2) + eps)) * sigmoid(gate), row by row; x and gate of one shape
at::Tensor gated_rms_norm_f32(const at::Tensor& x_in, const at::Tensor& gate_in, const at::Tensor& weight, double eps) {
    check_rows(x_in, "x");
    check_rows(gate_in, "gate");
    check_rows(weight, "weight");
    TORCH_CHECK(gate_in.sizes() == x_in.sizes(), "gate must have x's shape");
    at::Tensor x = x_in.contiguous(), gate = gate_in.contiguous();
    const int64_t D = x.size(-1), rows = D ? x.numel() / D : 0;
    TORCH_CHECK(weight.numel() == D, "weight has ", weight.numel(), " entries for rows of ", D);
    at::Tensor y = at::empty(x.sizes(), x.options());
    const float *xp = x.data_ptr<float>(), *gp = gate.data_ptr<float>();
    const float* wp = weight.contiguous().data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const float e = static_cast<float>(eps);
    at::parallel_for(0, rows, grain(D), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
            const float* row = xp + r * D;
            const float* g = gp + r * D;
            float* out = yp + r * D;
            const float inv = 1.f / std::sqrt(ouro::sumsq(row, D) / static_cast<float>(D) + e);
            ouro::sigmoid_row(out, g, D);
            for (int64_t i = 0; i < D; ++i) out[i] = wp[i] * (row[i] * inv) * out[i];
        }
    });
    return y;
}

// silu(min(gate, limit)) * clamp(up, -limit, limit); gate and up are [T, I] views (e.g. the two
// halves of one merged gate/up product) with any row stride
at::Tensor clamped_swiglu_f32(const at::Tensor& gate, const at::Tensor& up, double limit) {
    check_rows(gate, "gate");
    check_rows(up, "up");
    TORCH_CHECK(gate.dim() == 2 && up.sizes() == gate.sizes(), "gate and up must be [T, I] of one shape");
    const int64_t T = gate.size(0), I = gate.size(1), gs = gate.stride(0), us = up.stride(0);
    at::Tensor y = at::empty({T, I}, gate.options());
    const float* gp = gate.data_ptr<float>();
    const float* up_ = up.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const float lim = static_cast<float>(limit);
    at::parallel_for(0, T, grain(I, SIGMOID_GRAIN_ELEMENTS), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) ouro::clamped_swiglu_row(yp + r * I, gp + r * gs, up_ + r * us, I, lim);
    });
    return y;
}

// the ops: float32 inside, a bfloat16 model's rows converted at the boundary (`boundary.h`)
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
    return ouro::as_dtype(rms_norm_f32(ouro::f32(x), ouro::f32(weight), eps), x.scalar_type());
}

at::Tensor gated_rms_norm(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& weight, double eps) {
    return ouro::as_dtype(gated_rms_norm_f32(ouro::f32(x), ouro::f32(gate), ouro::f32(weight), eps), x.scalar_type());
}

at::Tensor clamped_swiglu(const at::Tensor& gate, const at::Tensor& up, double limit) {
    return ouro::as_dtype(clamped_swiglu_f32(ouro::f32(gate), ouro::f32(up), limit), gate.scalar_type());
}

std::string norms_isa(int64_t force_portable) { return ouro::isa_switch(force_portable); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(ouro_native, m) {
    m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
    m.def("gated_rms_norm(Tensor x, Tensor gate, Tensor weight, float eps) -> Tensor");
    m.def("clamped_swiglu(Tensor gate, Tensor up, float limit) -> Tensor");
    m.def("norms_isa(int force_portable) -> str", &norms_isa);
}

TORCH_LIBRARY_IMPL(ouro_native, CPU, m) {
    m.impl("rms_norm", &rms_norm);
    m.impl("gated_rms_norm", &gated_rms_norm);
    m.impl("clamped_swiglu", &clamped_swiglu);
}
