// The routed experts of a decode step (or any step with a few rows per expert) in float32, as one
// op: (token, choice) pairs grouped by expert with a counting sort, then each active expert's
// weights streamed once for all of its rows: gate/up rows two at a time against four token rows
// (`dot_2x4`, eight independent sums), the clamped SwiGLU in the same loop, then the down rows
// against four hidden rows, and each token's k outputs weighted and summed in choice order.
//
// torch ran this as a padded batched matmul (every expert padded to the busiest one's row count):
// at 1-8 rows an expert, BLAS's small-M kernels and the padding kept it at ~4.7x its weight-read
// floor on `small`. Here the work is (expert, block of output channels) tasks over torch's thread
// pool; every row's sums run in one fixed order whatever rows share its expert (a short group is
// padded with repeats of its last row), so a token's result never depends on its batch.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "by_expert.h"
#include "vec.h"

namespace {

constexpr int64_t BLOCK = 32;   // output channels per task: 32 x D floats of weights, a few L2 lines' worth

inline float swiglu(float g, float u, float lim) {
    // std::min / std::max keep a NaN first argument: NaN stays NaN, as torch's clamp keeps it
    return ouro::silu(std::min(g, lim)) * std::min(std::max(u, -lim), lim);
}

// rows[0..n) of `src` (each `width` long) in groups of four; `fn(rowptrs[4], first, count)`
template <typename F>
void by_four(const std::vector<int64_t>& rows, int64_t begin, int64_t end, const float* src, int64_t width, F fn) {
    for (int64_t r = begin; r < end; r += 4) {
        const int64_t c = std::min<int64_t>(4, end - r);
        const float* p[4];
        for (int64_t i = 0; i < 4; ++i) p[i] = src + rows[r + std::min(i, c - 1)] * width;
        fn(p, r, c);
    }
}

at::Tensor moe_experts(const at::Tensor& x_in, const at::Tensor& weights_in, const at::Tensor& experts_in,
                       const at::Tensor& gate_up_in, const at::Tensor& down_in, double limit) {
    TORCH_CHECK(x_in.scalar_type() == at::kFloat && gate_up_in.scalar_type() == at::kFloat &&
                down_in.scalar_type() == at::kFloat, "moe_experts: x and the expert weights must be float32");
    TORCH_CHECK(experts_in.scalar_type() == at::kLong, "moe_experts: experts must be int64");
    const at::Tensor x = x_in.contiguous(), gate_up = gate_up_in.contiguous(), down = down_in.contiguous();
    const at::Tensor w = weights_in.to(at::kFloat).contiguous(), ex = experts_in.contiguous();
    const int64_t T = x.size(0), D = x.size(1), k = ex.size(1), E = gate_up.size(0), I = down.size(2);
    TORCH_CHECK(gate_up.size(1) == 2 * I && gate_up.size(2) == D && down.size(1) == D,
                "moe_experts: gate_up must be [E, 2I, D] and down [E, D, I]");
    const int64_t N = T * k;
    const int64_t* exp = ex.data_ptr<int64_t>();
    // the (token, choice) pairs by expert, stable (`by_expert.h`)
    const ouro::ExpertOrder order = ouro::order_by_expert(exp, N, k, E, "moe_experts");
    const std::vector<int64_t>&start = order.start, &pos = order.pos, &token_row = order.token;
    std::vector<int64_t> active;
    for (int64_t e = 0; e < E; ++e)
        if (start[e + 1] > start[e]) active.push_back(e);
    std::vector<int64_t> sorted_rows(N);
    for (int64_t i = 0; i < N; ++i) sorted_rows[i] = i;

    at::Tensor h = at::empty({N, I}, x.options());       // hidden rows in sorted order
    at::Tensor y = at::empty({N, D}, x.options());       // expert outputs in sorted order
    at::Tensor out = at::empty({T, D}, x.options());
    const float *xp = x.data_ptr<float>(), *gp = gate_up.data_ptr<float>(), *dp = down.data_ptr<float>();
    float *hp = h.data_ptr<float>(), *yp = y.data_ptr<float>(), *op = out.data_ptr<float>();
    const float lim = static_cast<float>(limit);
    const int64_t A = static_cast<int64_t>(active.size());

    const int64_t up_blocks = (I + BLOCK - 1) / BLOCK;
    at::parallel_for(0, A * up_blocks, 1, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
            const int64_t e = active[t / up_blocks], j0 = (t % up_blocks) * BLOCK, j1 = std::min(I, j0 + BLOCK);
            const float* We = gp + e * 2 * I * D;
            for (int64_t j = j0; j < j1; ++j) {
                const float* pair[2] = {We + j * D, We + (I + j) * D};
                by_four(token_row, start[e], start[e + 1], xp, D, [&](const float* const* rows, int64_t r, int64_t c) {
                    float s[8];
                    ouro::dot_2x4(pair, rows, D, s);
                    for (int64_t i = 0; i < c; ++i) hp[(r + i) * I + j] = swiglu(s[i], s[4 + i], lim);
                });
            }
        }
    });
    const int64_t down_blocks = (D + BLOCK - 1) / BLOCK;
    at::parallel_for(0, A * down_blocks, 1, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
            const int64_t e = active[t / down_blocks], d0 = (t % down_blocks) * BLOCK, d1 = std::min(D, d0 + BLOCK);
            const float* We = dp + e * D * I;
            for (int64_t d = d0; d < d1; d += 2) {
                const int64_t d2 = std::min(d + 1, d1 - 1);     // an odd tail repeats its last row
                const float* pair[2] = {We + d * I, We + d2 * I};
                by_four(sorted_rows, start[e], start[e + 1], hp, I, [&](const float* const* rows, int64_t r, int64_t c) {
                    float s[8];
                    ouro::dot_2x4(pair, rows, I, s);
                    for (int64_t i = 0; i < c; ++i) {
                        yp[(r + i) * D + d] = s[i];
                        yp[(r + i) * D + d2] = s[4 + i];
                    }
                });
            }
        }
    });
    const float* wp = w.data_ptr<float>();
    at::parallel_for(0, T, std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, D * k)), [&](int64_t r0, int64_t r1) {
        std::vector<const float*> rows(k);
        for (int64_t t = r0; t < r1; ++t) {
            for (int64_t j = 0; j < k; ++j) rows[j] = yp + pos[t * k + j] * D;
            ouro::lincomb(op + t * D, wp + t * k, rows.data(), k, D);
        }
    });
    return out;
}

std::string experts_isa(int64_t force_portable) { return ouro::isa_switch(force_portable); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(ouro_native, m) {
    m.def("moe_experts(Tensor x, Tensor weights, Tensor experts, Tensor gate_up, Tensor down, float limit) -> Tensor");
    m.def("experts_isa(int force_portable) -> str", &experts_isa);
}

TORCH_LIBRARY_IMPL(ouro_native, CPU, m) {
    m.impl("moe_experts", &moe_experts);
}
