// The routed experts of a step in float32 (weights float32 or bfloat16), as one op: (token, choice) pairs grouped by expert with a
// counting sort, each active expert's products over its rows, the clamped SwiGLU between them, and
// each token's k outputs weighted and summed in choice order. Two forms of the products:
//
// - streamed (decode, a few rows an expert): each expert's weights read once for all of its rows.
//   float32 weights one row at a time against up to four token rows (`dot_1xn`): each thread reads its
//   stretch of the weights front to back, a block's gate rows, then its up rows with the SwiGLU, then
//   the down rows (a gate and an up row side by side were two streams 1 MB apart: in one process,
//   calls alternating, cold weights, the Zen 4 VM, 7 layers of `small`'s experts 1.95-3.19 ->
//   1.80-2.45 ms at one token, 14.0-19.9 -> 13.3-18.1 at 16; the same bits). bfloat16 weights keep
//   gate and up rows two at a time (`dot_2x4`): widening a loaded row is work two rows a pass share,
//   and one row at a time ran them 1.2-1.3x slower. torch ran this as a padded
//   batched matmul: at 1-8 rows an expert BLAS's small-M kernels and the padding kept it at ~4.7x
//   its weight-read floor on `small`.
// - tiled (prefill, tens of rows an expert and more): a grouped GEMM. Tasks are (expert, chunk of its
//   rows, group of panels); a task packs each panel of weight rows [K][PANEL] (`tiles.h`) and runs
//   PANEL_ROWS rows at a time against it with every sum in registers. A gate/up panel holds matching
//   gate and up channels side by side, so the SwiGLU is the first product's epilogue and the [rows, 2I]
//   products never reach memory. torch ran prefill as a padded batched matmul or one matmul per
//   expert (~100 GFLOP/s here against BLAS's ~175 on one large product).
//
// Work is split over torch's thread pool; every row's sums run in one fixed order whatever rows share
// its expert (a short group is padded with repeats of its last row), so a token's result never
// depends on its batch within a form (deterministic inference keeps the streamed form at any count).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "boundary.h"
#include "by_expert.h"
#include "vec.h"

namespace {

constexpr int64_t AHEAD = 2;    // bfloat16 weight rows prefetched this many rows (gate/up channels, down pairs) ahead
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

// one weight row against the c (1-4) rows of a `by_four` group, loading only the rows there are
// (`dot_1xn`: each row's sum the same bits whichever c)
inline void dot_rows(const float* w, const float* const* x, int64_t c, int64_t n, float v[4]) {
    if (c == 1)
        ouro::dot_1xn<1>(w, x, n, v);
    else if (c == 2)
        ouro::dot_1xn<2>(w, x, n, v);
    else
        ouro::dot_1x4(w, x, n, v);
}

template <typename W>   // the weights' element: float, or bfloat16's bits (`ouro::bf16_t`)
struct Step {   // what both forms read and write
    const float* x;
    const W *gate_up, *down;
    float *h, *y;                     // hidden and output rows, in sorted order
    int64_t D, I;
    float lim;
    const ouro::ExpertOrder* order;
    const std::vector<int64_t>* active;
};

// One task of the gate/up product: expert e's channels [j0, j1) for all of its rows into s.h, the
// SwiGLU applied. float32 weights one weight row at a time (`dot_rows`): the block's gate rows (kept
// in `gate`), then its up rows, each stretch of the weights read front to back; bfloat16 weights a
// gate and an up row side by side (`dot_2x4`), prefetched AHEAD rows on: widening a loaded row is
// work two rows a pass share, and one row at a time ran them 1.2-1.3x slower (`docs/changelog.md`).
template <typename W>
void gate_up_task(const Step<W>& s, int64_t e, int64_t j0, int64_t j1, std::vector<float>& gate) {
    const int64_t D = s.D, I = s.I, r0 = s.order->start[e], r1 = s.order->start[e + 1];
    const W* We = s.gate_up + e * 2 * I * D;
    if constexpr (sizeof(W) == sizeof(float)) {
        gate.resize((r1 - r0) * BLOCK);
        for (int64_t j = j0; j < j1; ++j)
            by_four(s.order->token, r0, r1, s.x, D, [&](const float* const* x, int64_t r, int64_t c) {
                float v[4];
                dot_rows(We + j * D, x, c, D, v);
                for (int64_t i = 0; i < c; ++i) gate[(r - r0 + i) * BLOCK + (j - j0)] = v[i];
            });
        for (int64_t j = j0; j < j1; ++j)
            by_four(s.order->token, r0, r1, s.x, D, [&](const float* const* x, int64_t r, int64_t c) {
                float v[4];
                dot_rows(We + (I + j) * D, x, c, D, v);
                for (int64_t i = 0; i < c; ++i)
                    s.h[(r + i) * I + j] = swiglu(gate[(r - r0 + i) * BLOCK + (j - j0)], v[i], s.lim);
            });
    } else {
        for (int64_t j = j0; j < j1; ++j) {
            const W* pair[2] = {We + j * D, We + (I + j) * D};
            if (j + AHEAD < I) {
                ouro::prefetch(pair[0] + AHEAD * D, D * sizeof(W));
                ouro::prefetch(pair[1] + AHEAD * D, D * sizeof(W));
            }
            by_four(s.order->token, r0, r1, s.x, D, [&](const float* const* x, int64_t r, int64_t c) {
                float v[8];
                ouro::dot_2x4(pair, x, D, v);
                for (int64_t i = 0; i < c; ++i) s.h[(r + i) * I + j] = swiglu(v[i], v[4 + i], s.lim);
            });
        }
    }
}

// One task of the down product: expert e's output channels [d0, d1) for all of its rows into s.y
// (`sorted`: the hidden rows' own order), one weight row at a time for float32, two for bfloat16
template <typename W>
void down_task(const Step<W>& s, int64_t e, int64_t d0, int64_t d1, const std::vector<int64_t>& sorted) {
    const int64_t D = s.D, I = s.I, r0 = s.order->start[e], r1 = s.order->start[e + 1];
    const W* We = s.down + e * D * I;
    if constexpr (sizeof(W) == sizeof(float)) {
        for (int64_t d = d0; d < d1; ++d)
            by_four(sorted, r0, r1, s.h, I, [&](const float* const* h, int64_t r, int64_t c) {
                float v[4];
                dot_rows(We + d * I, h, c, I, v);
                for (int64_t i = 0; i < c; ++i) s.y[(r + i) * D + d] = v[i];
            });
    } else {
        for (int64_t d = d0; d < d1; d += 2) {
            const int64_t d2 = std::min(d + 1, d1 - 1);     // an odd tail repeats its last row
            const W* pair[2] = {We + d * I, We + d2 * I};
            if (d + 2 * AHEAD + 1 < D) ouro::prefetch(We + (d + 2 * AHEAD) * I, 2 * I * sizeof(W));
            by_four(sorted, r0, r1, s.h, I, [&](const float* const* h, int64_t r, int64_t c) {
                float v[8];
                ouro::dot_2x4(pair, h, I, v);
                for (int64_t i = 0; i < c; ++i) {
                    s.y[(r + i) * D + d] = v[i];
                    s.y[(r + i) * D + d2] = v[4 + i];
                }
            });
        }
    }
}

template <typename W>
void streamed(const Step<W>& s) {
    const int64_t D = s.D, I = s.I, A = static_cast<int64_t>(s.active->size());
    std::vector<int64_t> sorted_rows(s.order->pos.size());
    for (size_t i = 0; i < sorted_rows.size(); ++i) sorted_rows[i] = static_cast<int64_t>(i);
    const int64_t up_blocks = (I + BLOCK - 1) / BLOCK;
    at::parallel_for(0, A * up_blocks, 1, [&](int64_t t0, int64_t t1) {
        std::vector<float> gate;
        for (int64_t t = t0; t < t1; ++t) {
            const int64_t j0 = (t % up_blocks) * BLOCK;
            gate_up_task(s, (*s.active)[t / up_blocks], j0, std::min(I, j0 + BLOCK), gate);
        }
    });
    const int64_t down_blocks = (D + BLOCK - 1) / BLOCK;
    at::parallel_for(0, A * down_blocks, 1, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
            const int64_t d0 = (t % down_blocks) * BLOCK;
            down_task(s, (*s.active)[t / down_blocks], d0, std::min(D, d0 + BLOCK), sorted_rows);
        }
    });
}

// Measured on one AVX2 core (32 experts x 256 rows, K = N = 512, a standalone copy of this loop,
// interleaved): 71 GFLOP/s at 192 rows, 256 columns, 4 panels; 77-79 at the sizes below (a whole
// expert's rows in one chunk, so its panels are packed once; the packing is ~6% of the time)
constexpr int64_t TILE_ROWS = 43 * ouro::PANEL_ROWS;   // rows of one expert per task
constexpr int64_t TILE_PANELS = 8;                     // panels per task
constexpr int64_t TILE_K = 128;                        // columns of A per pass: an 8 KB block of a panel in L1
constexpr int64_t BLOCK_STRIDE = TILE_K + 16;          // a copied row of A: 9 cache lines, so rows do not alias

// Tasks (chunk of one expert's rows, group of panels) over torch's pool. `weight_row(e, p, j)`: the
// weight row in column j of expert e's panel p (null past the edge); `row(r)`: row r of A;
// `epilogue(c, r, n, p)`: the n valid rows from r of panel p's sums c [PANEL_ROWS][PANEL]. Each panel
// is packed once per task and run TILE_K columns at a time over all of the chunk's rows, their sums
// kept in a [TILE_ROWS][PANEL] buffer between passes.
template <typename W, typename WeightRow, typename Row, typename Epilogue>
void tiled_product(const Step<W>& s, int64_t K, int64_t panels, WeightRow weight_row, Row row, Epilogue epilogue) {
    using ouro::PANEL;
    using ouro::PANEL_ROWS;
    const std::vector<int64_t>& start = s.order->start;
    std::vector<int64_t> chunk_expert, chunk_row;
    for (int64_t e : *s.active)
        for (int64_t r = start[e]; r < start[e + 1]; r += TILE_ROWS) {
            chunk_expert.push_back(e);
            chunk_row.push_back(r);
        }
    const int64_t groups = (panels + TILE_PANELS - 1) / TILE_PANELS, C = static_cast<int64_t>(chunk_row.size());
    at::parallel_for(0, C * groups, 1, [&](int64_t t0, int64_t t1) {
        std::vector<float> b(TILE_PANELS * K * PANEL), sums(TILE_PANELS * TILE_ROWS * PANEL), block(TILE_ROWS * BLOCK_STRIDE);
        for (int64_t t = t0; t < t1; ++t) {
            const int64_t e = chunk_expert[t / groups], r0 = chunk_row[t / groups];
            const int64_t r1 = std::min(start[e + 1], r0 + TILE_ROWS), g = t % groups;
            const int64_t p0 = g * TILE_PANELS, np = std::min(panels - p0, TILE_PANELS);
            for (int64_t q = 0; q < np; ++q) {
                const W* w[PANEL];
                for (int64_t j = 0; j < PANEL; ++j) w[j] = weight_row(e, p0 + q, j);
                ouro::pack_panel(w, K, b.data() + q * K * PANEL);
            }
            // a block of the chunk's rows (TILE_ROWS x TILE_K) copied to rows of a stride that maps them to
            // different cache sets (rows of a power-of-two length alias), then against each panel's block
            for (int64_t k0 = 0; k0 < K; k0 += TILE_K) {
                const int64_t kn = std::min(TILE_K, K - k0);
                for (int64_t r = r0; r < r1; ++r) std::memcpy(block.data() + (r - r0) * BLOCK_STRIDE, row(r) + k0, kn * sizeof(float));
                for (int64_t q = 0; q < np; ++q)
                    for (int64_t r = r0; r < r1; r += PANEL_ROWS) {
                        const int64_t n = std::min(PANEL_ROWS, r1 - r);
                        const float* a[PANEL_ROWS];
                        for (int64_t i = 0; i < PANEL_ROWS; ++i) a[i] = block.data() + (r - r0 + std::min(i, n - 1)) * BLOCK_STRIDE;
                        ouro::panel_tile(a, b.data() + (q * K + k0) * PANEL, kn,
                                         sums.data() + (q * TILE_ROWS + r - r0) * PANEL, k0 > 0);
                    }
            }
            for (int64_t q = 0; q < np; ++q)
                for (int64_t r = r0; r < r1; r += PANEL_ROWS)
                    epilogue(sums.data() + (q * TILE_ROWS + r - r0) * PANEL, r, std::min(PANEL_ROWS, r1 - r), p0 + q);
        }
    });
}

template <typename W>
void tiled(const Step<W>& s) {
    using ouro::PANEL;
    const int64_t D = s.D, I = s.I, half = PANEL / 2;
    // gate/up: panel p holds gate channels p*half .. and the matching up channels
    tiled_product(s, D, (I + half - 1) / half,
        [&](int64_t e, int64_t p, int64_t j) -> const W* {
            const int64_t ch = p * half + j % half;
            return ch < I ? s.gate_up + (e * 2 * I + (j < half ? ch : I + ch)) * D : nullptr;
        },
        [&](int64_t r) { return s.x + s.order->token[r] * D; },
        [&](const float* c, int64_t r, int64_t n, int64_t p) {
            const int64_t j0 = p * half, m = std::min(half, I - j0);
            for (int64_t i = 0; i < n; ++i)
                ouro::clamped_swiglu_row(s.h + (r + i) * I + j0, c + i * PANEL, c + i * PANEL + half, m, s.lim);
        });
    // down: panel p holds output channels p*PANEL ..
    tiled_product(s, I, (D + PANEL - 1) / PANEL,
        [&](int64_t e, int64_t p, int64_t j) -> const W* {
            const int64_t ch = p * PANEL + j;
            return ch < D ? s.down + (e * D + ch) * I : nullptr;
        },
        [&](int64_t r) { return s.h + r * I; },
        [&](const float* c, int64_t r, int64_t n, int64_t p) {
            const int64_t d0 = p * PANEL, m = std::min(PANEL, D - d0);
            for (int64_t i = 0; i < n; ++i)
                for (int64_t j = 0; j < m; ++j) s.y[(r + i) * D + d0 + j] = c[i * PANEL + j];
        });
}

// the products over weights of type W, then each token's k outputs weighted and summed
template <typename W>
void run_experts(const at::Tensor& x, const at::Tensor& w, const at::Tensor& gate_up, const at::Tensor& down,
                 const ouro::ExpertOrder& order, const std::vector<int64_t>& active, at::Tensor& out, int64_t k,
                 float lim, bool tile) {
    const int64_t T = x.size(0), D = x.size(1), I = down.size(2), N = T * k;
    at::Tensor h = at::empty({N, I}, x.options());       // hidden rows in sorted order
    at::Tensor y = at::empty({N, D}, x.options());       // expert outputs in sorted order
    const Step<W> s{x.data_ptr<float>(), static_cast<const W*>(gate_up.data_ptr()), static_cast<const W*>(down.data_ptr()),
                    h.data_ptr<float>(), y.data_ptr<float>(), D, I, lim, &order, &active};
    if (tile)
        tiled(s);
    else
        streamed(s);
    const float *wp = w.data_ptr<float>(), *yp = y.data_ptr<float>();
    float* op = out.data_ptr<float>();
    at::parallel_for(0, T, std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, D * k)), [&](int64_t r0, int64_t r1) {
        std::vector<const float*> rows(k);
        for (int64_t t = r0; t < r1; ++t) {
            for (int64_t j = 0; j < k; ++j) rows[j] = yp + order.pos[t * k + j] * D;
            ouro::lincomb(op + t * D, wp + t * k, rows.data(), k, D);
        }
    });
}

// x and the weights float32, or a bfloat16 model's: its rows converted at the boundary (`boundary.h`),
// its expert weights read as they are (widened to float32 in registers), the output in x's dtype
at::Tensor moe_experts(const at::Tensor& x_in, const at::Tensor& weights_in, const at::Tensor& experts_in,
                       const at::Tensor& gate_up_in, const at::Tensor& down_in, double limit, bool tile) {
    const at::ScalarType wt = gate_up_in.scalar_type();
    TORCH_CHECK((wt == at::kFloat || wt == at::kBFloat16) && down_in.scalar_type() == wt &&
                (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
                "moe_experts: x and the expert weights must be float32 or bfloat16 (the weights of one dtype)");
    TORCH_CHECK(experts_in.scalar_type() == at::kLong, "moe_experts: experts must be int64");
    const at::Tensor x = ouro::f32(x_in).contiguous(), gate_up = gate_up_in.contiguous(), down = down_in.contiguous();
    const at::Tensor w = weights_in.to(at::kFloat).contiguous(), ex = experts_in.contiguous();
    const int64_t T = x.size(0), D = x.size(1), k = ex.size(1), E = gate_up.size(0), I = down.size(2);
    TORCH_CHECK(gate_up.size(1) == 2 * I && gate_up.size(2) == D && down.size(1) == D,
                "moe_experts: gate_up must be [E, 2I, D] and down [E, D, I]");
    // the (token, choice) pairs by expert, stable (`by_expert.h`)
    const ouro::ExpertOrder order = ouro::order_by_expert(ex.data_ptr<int64_t>(), T * k, k, E, "moe_experts");
    std::vector<int64_t> active;
    for (int64_t e = 0; e < E; ++e)
        if (order.start[e + 1] > order.start[e]) active.push_back(e);
    at::Tensor out = at::empty({T, D}, x.options());
    if (wt == at::kBFloat16)
        run_experts<ouro::bf16_t>(x, w, gate_up, down, order, active, out, k, static_cast<float>(limit), tile);
    else
        run_experts<float>(x, w, gate_up, down, order, active, out, k, static_cast<float>(limit), tile);
    return ouro::as_dtype(out, x_in.scalar_type());
}

std::string experts_isa(int64_t force_portable) { return ouro::isa_switch(force_portable); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(ouro_native, m) {
    m.def("moe_experts(Tensor x, Tensor weights, Tensor experts, Tensor gate_up, Tensor down, float limit, "
          "bool tiled=False) -> Tensor");
    m.def("experts_isa(int force_portable) -> str", &experts_isa);
}

TORCH_LIBRARY_IMPL(ouro_native, CPU, m) {
    m.impl("moe_experts", &moe_experts);
}
