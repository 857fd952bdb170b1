// A float32 product x [M, K] @ w [N, K].T for a decode step's rows (`gemm_pick.PANEL_ROWS` at most), on
// a copy of the weight packed once into panels of PANEL columns laid out [K][PANEL] (`tiles.h`:
// `pack_panel`, `panel_tile`): each weight value is read once, from one sequential stream a panel, and
// multiplied by a broadcast value of every row in registers, ROWS rows a pass (8 on AVX-512: 16 sums of
// two registers, 6 on AVX2). oneDNN's packed product ran 16 rows of such shapes at 101-142 GFLOP/s
// with cold weights (K = 512, AMD EPYC Zen 4, 2 threads; 201 GFLOP/s peak), this tile at 149-168.
//
// Every output is chains of K_CHUNK fused multiply-adds from zero in order of k, their sums added in
// order, on every path (std::fma in the portable loop): the AVX-512, AVX2 and portable paths give the
// same bits, at any thread count, whatever rows share the call (a row's result depends only on its own
// row and column). The packed copies are kept like the oneDNN op's (`weight_cache.h`), one a weight.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>

#include "vec.h"
#include "weight_cache.h"

namespace {

using ouro::PANEL;
constexpr int ROWS = static_cast<int>(ouro::PANEL_ROWS);      // rows a register tile (8 on AVX-512, 6 on AVX2)
constexpr int64_t GRAIN_FLOATS = 1 << 14;     // 64 KB of weights per thread at least: less is not worth a wake-up
constexpr int64_t X_BLOCK_FLOATS = 1 << 16;   // 256 KB of rows a block (many rows: a prefill's)
constexpr int64_t K_CHUNK = 64;                // terms a chain sums before its sum joins the others

ouro::WeightCache cache;      // weight -> its panels

// w [N, K] as [ceil(N / PANEL), K, PANEL], the last panel's missing columns zero
at::Tensor pack(const at::Tensor& w) {
    const int64_t N = w.size(0), K = w.size(1), P = (N + PANEL - 1) / PANEL;
    at::Tensor out = at::empty({P, K, PANEL}, w.options());
    const float* wp = w.data_ptr<float>();
    float* op = out.data_ptr<float>();
    at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
        for (int64_t p = p0; p < p1; ++p) {
            const float* rows[PANEL];
            for (int64_t j = 0; j < PANEL; ++j) rows[j] = p * PANEL + j < N ? wp + (p * PANEL + j) * K : nullptr;
            ouro::pack_panel(rows, K, op + p * K * PANEL);
        }
    });
    return out;
}

at::Tensor panel_weight(const at::Tensor& w) {
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "panel_weight: the weight must be 2-D float32 [N, K], got ",
                w.sizes(), " ", w.scalar_type());
    return cache.get(w, pack);
}

// rows m0 .. m0 + r (r <= ROWS) of x against one panel, into c [r][PANEL]: each K_CHUNK terms summed
// from zero, the chunks' sums added in order (a sum of k terms in one chain errs by ~sqrt(k) roundings:
// at K = 513 twice F.linear's, and K runs to thousands in the large models)
template <int R>
void rows_tile(const float* x, int64_t ld, int64_t m0, const float* b, int64_t K, float* c) {
    const float* a[R];
    for (int i = 0; i < R; ++i) a[i] = x + (m0 + i) * ld;
    ouro::panel_tile<R>(a, b, std::min(K, K_CHUNK), c, false);
    float part[R * PANEL];
    for (int64_t k0 = K_CHUNK; k0 < K; k0 += K_CHUNK) {
        for (int i = 0; i < R; ++i) a[i] += K_CHUNK;
        ouro::panel_tile<R>(a, b + k0 * PANEL, std::min(K_CHUNK, K - k0), part, false);
        for (int64_t j = 0; j < R * PANEL; ++j) c[j] += part[j];
    }
}

template <int... R>
void tile(int r, const float* x, int64_t ld, int64_t m0, const float* b, int64_t K, float* c,
          std::integer_sequence<int, R...>) {
    ((r == R + 1 ? rows_tile<R + 1>(x, ld, m0, b, K, c) : void()), ...);
}

at::Tensor panel_linear(const at::Tensor& x_in, const at::Tensor& w) {
    TORCH_CHECK(x_in.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
                "panel_linear: x and w must be float32");
    TORCH_CHECK(x_in.dim() == 2 && w.dim() == 2 && x_in.size(1) == w.size(1),
                "panel_linear: x must be [M, K] and w [N, K], got ", x_in.sizes(), " and ", w.sizes());
    // rows read where they are (a slice of a wider tensor): only the columns must be contiguous
    const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
    const int64_t M = x.size(0), K = x.size(1), N = w.size(0), ld = x.stride(0);
    at::Tensor y = at::empty({M, N}, x.options());
    if (M == 0 || N == 0) return y;
    if (K == 0) return y.zero_();
    const at::Tensor packed = panel_weight(w);
    const float* xp = x.data_ptr<float>();
    const float* bp = packed.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const int64_t P = packed.size(0);
    const int64_t grain = std::max<int64_t>(1, GRAIN_FLOATS / std::max<int64_t>(1, PANEL * K));
    // a block of rows small enough to stay in L2 while every panel passes (a decode step's rows are one)
    const int64_t block = std::max<int64_t>(ROWS, X_BLOCK_FLOATS / std::max<int64_t>(1, K) / ROWS * ROWS);
    for (int64_t b0 = 0; b0 < M; b0 += block) {
        const int64_t b1 = std::min(M, b0 + block);
        at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
            float c[ROWS * PANEL];
            for (int64_t p = p0; p < p1; ++p) {
                const int64_t n0 = p * PANEL, nn = std::min<int64_t>(PANEL, N - n0);
                // the panel (K x PANEL floats) stays in L1/L2 for the later passes of rows
                for (int64_t m0 = b0; m0 < b1; m0 += ROWS) {
                    const int r = static_cast<int>(std::min<int64_t>(ROWS, b1 - m0));
                    tile(r, xp, ld, m0, bp + p * K * PANEL, K, c, std::make_integer_sequence<int, ROWS>{});
                    for (int i = 0; i < r; ++i) std::copy(c + i * PANEL, c + i * PANEL + nn, yp + (m0 + i) * N + n0);
                }
            }
        });
    }
    return y;
}

int64_t panel_cache_size() { return cache.size(); }

std::string panels_isa(int64_t force_portable) { return ouro::isa_switch(force_portable); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(ouro_native, m) {
    m.def("panel_linear(Tensor x, Tensor w) -> Tensor");
    m.def("panel_weight(Tensor w) -> Tensor", &panel_weight);
    m.def("panel_cache_size() -> int", &panel_cache_size);
    m.def("panels_isa(int force_portable) -> str", &panels_isa);
}

TORCH_LIBRARY_IMPL(ouro_native, CPU, m) {
    m.impl("panel_linear", &panel_linear);
}
