// A float32 product x [M, K] @ w [N, K].T for a few rows (decode: M = 1..8), as one op: the weight
// is streamed from memory once for all M rows. Work is split over blocks of BLOCK output channels
// (torch's thread pool, a static split); inside a block each group of up to four x rows (in L1)
// meets the block's weight rows a few at a time, every (row, channel) pair with its own vector
// accumulator, so a tile keeps 6-8 independent FMA chains in flight. Written once over `ouro::Lanes`
// (AVX-512 or AVX2, this CPU's width) with the portable loops beside it (`gemv_isa`, `portable()`).
//
// Every output element is summed in one fixed order whichever tile, block, thread or group of rows
// computes it: lane-wise over K in steps of the vector width from zero, the lanes' horizontal sum,
// then the last K % width products in order. A result thus depends only on its own row and channel
// (bit-identical at 1 or 2 threads, and whatever rows share the call). oneDNN's packed product ran
// these shapes at 12-17 GB/s of weights on an AVX2 Zen 3 (a [512, 512] weight: ~85 us at one row).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "vec.h"

namespace {

constexpr int64_t BLOCK = 8;                  // output channels per task
constexpr int64_t GROUP = 4;                  // x rows per pass over a block's weights
constexpr int64_t GRAIN_FLOATS = 1 << 14;     // 64 KB of weights per thread at least: less is not worth a wake-up
// weights are prefetched this many floats (16 KB) ahead of each load, a tile or two ahead at decode's
// K = 512: on the AVX2 Zen 3 it took 15-25% off 4-8 rows' time and ~5% off one row's (streamed from DRAM)
constexpr int64_t PREFETCH = 4096;
// up to this many rows a block's channels run one at a time, unprefetched: each thread reads its
// weights as one sequential stream, which the hardware prefetcher follows better than several rows
// side by side (eight streams 2 KB apart). Zen 4 VM, 40 cold [1536, 512] weights: 1 row 23 -> 27,
// 2 rows 20 -> 27, 3 rows 16 -> 24 GB/s; 4 and 8 rows slower so (18 -> 15-21, 16 -> 12-14). A
// channel's sum is the same either way (its own accumulator, the same order).
constexpr int64_t STREAM_ROWS = 3;

// y[m][n + r] for r < R, m < MB from the R weight rows at w (row stride K) and the MB rows x[m]
#if defined(OURO_LANES)
using ouro::Lanes;

template <int R, int MB, bool PF = true>
inline void tile(const float* w, int64_t K, const float* const* x, float* const* y, int64_t n) {
    Lanes::T acc[R][MB];
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < MB; ++m) acc[r][m] = Lanes::zero();
    int64_t i = 0;
    for (; i + Lanes::W <= K; i += Lanes::W) {
        // each row in a register for all its products (`asm`: else GCC may fold one side's loads
        // into every FMA, and the loads, not the FMAs, set the pace)
        Lanes::T xv[MB];
        for (int m = 0; m < MB; ++m) {
            xv[m] = Lanes::load(x[m] + i);
            asm("" : "+v"(xv[m]));
        }
        for (int r = 0; r < R; ++r) {
            if constexpr (PF) _mm_prefetch(reinterpret_cast<const char*>(w + r * K + i + PREFETCH), _MM_HINT_T0);
            Lanes::T wv = Lanes::load(w + r * K + i);
            asm("" : "+v"(wv));
            for (int m = 0; m < MB; ++m) acc[r][m] = Lanes::fma(wv, xv[m], acc[r][m]);
        }
    }
    float s[R * MB];
    if constexpr (R * MB == 16)           // the registers reduced together, each as Lanes::sum would
        ouro::sum_16(&acc[0][0], s);
    else if constexpr (R * MB == 8)
        ouro::sum_8(&acc[0][0], s);
    else
        for (int k = 0; k < R * MB; ++k) s[k] = Lanes::sum(acc[k / MB][k % MB]);
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < MB; ++m) {
            float v = s[r * MB + m];
            for (int64_t j = i; j < K; ++j) v = std::fma(w[r * K + j], x[m][j], v);
            y[m][n + r] = v;
        }
}

// one block's channels [n0, n1) against the MB rows x[0..MB): full blocks in tiles of R channels
// (R * MB <= 8 accumulators), a short last block one channel at a time
template <int MB>
void block_lanes(const float* w, int64_t K, const float* const* x, float* const* y, int64_t n0, int64_t n1) {
    int64_t n = n0;
    if constexpr (MB <= STREAM_ROWS) {
        for (; n < n1; ++n) tile<1, MB, false>(w + n * K, K, x, y, n);
        return;
    }
    // R * MB accumulators: 8, or 16 at four rows where 32 registers hold them (AVX-512)
    constexpr int R = MB == 4 && Lanes::W == 16 ? 4 : 2;
    if (n1 - n0 == BLOCK)
        for (; n < n1; n += R) tile<R, MB>(w + n * K, K, x, y, n);
    for (; n < n1; ++n) tile<1, MB>(w + n * K, K, x, y, n);
}
#endif

// the portable loops, in the vector paths' shape: 8 lane sums over K, their sum pairwise, the tail
void block_portable(const float* w, int64_t K, const float* const* x, int64_t mb, float* const* y, int64_t n0,
                    int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
        const float* wr = w + n * K;
        for (int64_t m = 0; m < mb; ++m) {
            float lane[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            int64_t i = 0;
            for (; i + 8 <= K; i += 8)
                for (int l = 0; l < 8; ++l) lane[l] += wr[i + l] * x[m][i + l];
            for (int l = 0; l < 4; ++l) lane[l] += lane[l + 4];
            float s = (lane[0] + lane[2]) + (lane[1] + lane[3]);
            for (; i < K; ++i) s += wr[i] * x[m][i];
            y[m][n] = s;
        }
    }
}

void block(const float* w, int64_t K, const float* const* x, int64_t mb, float* const* y, int64_t n0, int64_t n1) {
    if (!ouro::portable()) {
#if defined(OURO_LANES)
        switch (mb) {
            case 1: return block_lanes<1>(w, K, x, y, n0, n1);
            case 2: return block_lanes<2>(w, K, x, y, n0, n1);
            case 3: return block_lanes<3>(w, K, x, y, n0, n1);
            default: return block_lanes<4>(w, K, x, y, n0, n1);
        }
#endif
    }
    block_portable(w, K, x, mb, y, n0, n1);
}

at::Tensor gemv(const at::Tensor& x_in, const at::Tensor& w_in) {
    TORCH_CHECK(x_in.scalar_type() == at::kFloat && w_in.scalar_type() == at::kFloat, "gemv: x and w must be float32");
    TORCH_CHECK(x_in.dim() == 2 && w_in.dim() == 2 && x_in.size(1) == w_in.size(1),
                "gemv: x must be [M, K] and w [N, K], got ", x_in.sizes(), " and ", w_in.sizes());
    const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
    const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
    at::Tensor y = at::empty({M, N}, x.options());
    if (M == 0 || N == 0) return y;
    const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const int64_t blocks = (N + BLOCK - 1) / BLOCK;
    const int64_t grain = std::max<int64_t>(1, GRAIN_FLOATS / std::max<int64_t>(1, BLOCK * K));
    at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) {
            const int64_t n0 = b * BLOCK, n1 = std::min(N, n0 + BLOCK);
            // the block's weights (BLOCK x K floats) stay in L1/L2 for the later groups of rows
            for (int64_t m0 = 0; m0 < M; m0 += GROUP) {
                const int64_t mb = std::min(GROUP, M - m0);
                const float* xs[GROUP];
                float* ys[GROUP];
                for (int64_t m = 0; m < mb; ++m) {
                    xs[m] = xp + (m0 + m) * K;
                    ys[m] = yp + (m0 + m) * N;
                }
                block(wp, K, xs, mb, ys, n0, n1);
            }
        }
    });
    return y;
}

std::string gemv_isa(int64_t force_portable) { return ouro::isa_switch(force_portable); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(ouro_native, m) {
    m.def("gemv(Tensor x, Tensor w) -> Tensor");
    m.def("gemv_isa(int force_portable) -> str", &gemv_isa);
}

TORCH_LIBRARY_IMPL(ouro_native, CPU, m) {
    m.impl("gemv", &gemv);
}
