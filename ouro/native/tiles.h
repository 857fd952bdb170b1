// Register tiles: several rows against several others in one pass over their length, every partial
// sum held in its own vector register, so each row is loaded once for the whole tile and enough
// independent FMA chains are in flight to hide their latency. Each tile is written once over
// `Lanes` (one register of float32 lanes: 16 on AVX-512, 8 on AVX2) plus the portable loop; a sum's
// order is the same whichever slot of a tile it sits in, so a row's result never depends on its
// neighbours. Included at the end of vec.h: every kernel that includes vec.h has these too.
#pragma once
#include "vec.h"

namespace ouro {

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define OURO_LANES 1
#if defined(__AVX512F__)
#define OURO_PS(op) _mm512_##op##_ps
#else
#define OURO_PS(op) _mm256_##op##_ps
#endif
// one register of float32 lanes at this CPU's width and the operations the tiles use
struct Lanes {
#if defined(__AVX512F__)
    using T = __m512;
    static constexpr int W = 16;
    static float sum(T v) { return _mm512_reduce_add_ps(v); }
#else
    using T = __m256;
    static constexpr int W = 8;
    static float sum(T v) { return hsum256(v); }
#endif
    static T zero() { return OURO_PS(setzero)(); }
    static T set1(float a) { return OURO_PS(set1)(a); }
    static T load(const float* p) { return OURO_PS(loadu)(p); }
    // bfloat16 values (their bits, `bf16_t`) widened to float32 lanes (vec.h's load512 / load256)
#if defined(__AVX512F__)
    static T load(const bf16_t* p) { return load512(p); }
#else
    static T load(const bf16_t* p) { return load256(p); }
#endif
    static void store(float* p, T v) { OURO_PS(storeu)(p, v); }
    static T mul(T a, T b) { return OURO_PS(mul)(a, b); }
    static T fma(T a, T b, T c) { return OURO_PS(fmadd)(a, b, c); }
};
#undef OURO_PS

// rescale_lincomb_4's (RESCALE) and lincomb_4's vector part from element i on, NV registers per output
// at a time; returns where it stopped. Each sum starts from a[j] * y[j] (RESCALE) or from its first
// term's product, then one FMA a term in order of k
template <int NV, bool RESCALE, typename X>
inline int64_t lincomb_4_lanes(float* const y[4], const float* a, const float* const c[4], const X* const* x,
                               int64_t m, int64_t n, int64_t i) {
    using L = Lanes;
    for (; i + NV * L::W <= n; i += NV * L::W) {
        L::T acc[NV][4], xv[NV];
        if (!RESCALE)
            for (int v = 0; v < NV; ++v) xv[v] = L::load(x[0] + i + v * L::W);
        for (int j = 0; j < 4; ++j) {
            const L::T va = L::set1(RESCALE ? a[j] : c[j][0]);
            for (int v = 0; v < NV; ++v) acc[v][j] = L::mul(va, RESCALE ? L::load(y[j] + i + v * L::W) : xv[v]);
        }
        for (int64_t k = RESCALE ? 0 : 1; k < m; ++k) {
            for (int v = 0; v < NV; ++v) xv[v] = L::load(x[k] + i + v * L::W);
            for (int j = 0; j < 4; ++j) {
                const L::T vc = L::set1(c[j][k]);
                for (int v = 0; v < NV; ++v) acc[v][j] = L::fma(vc, xv[v], acc[v][j]);
            }
        }
        for (int j = 0; j < 4; ++j)
            for (int v = 0; v < NV; ++v) L::store(y[j] + i + v * L::W, acc[v][j]);
    }
    return i;
}
// rows_tdot's vector part from column i on, NB registers of columns at a time; returns where it stopped
template <int NB, bool RANK1>
inline int64_t rows_tdot_lanes(float* x, int64_t rows, int64_t n, int64_t ld, const float* a, const float* u,
                               const float* b, float* y, int64_t i) {
    using L = Lanes;
    for (; i + NB * L::W <= n; i += NB * L::W) {
        L::T acc[NB], uv[NB];
        for (int j = 0; j < NB; ++j) {
            acc[j] = L::zero();
            uv[j] = RANK1 ? L::load(u + i + j * L::W) : acc[j];
        }
        for (int64_t r = 0; r < rows; ++r) {
            float* xr = x + r * ld + i;
            const L::T va = L::set1(a[r]), vb = L::set1(b[r]);
            for (int j = 0; j < NB; ++j) {
                const L::T old = L::load(xr + j * L::W);
                const L::T v = RANK1 ? L::fma(va, uv[j], old) : L::mul(old, va);
                L::store(xr + j * L::W, v);
                acc[j] = L::fma(vb, v, acc[j]);
            }
        }
        for (int j = 0; j < NB; ++j) L::store(y + i + j * L::W, acc[j]);
    }
    return i;
}
#endif

// Rows against a packed panel of columns (a grouped GEMM's tile, `experts.cpp`): PANEL columns laid
// out [K][PANEL] by `pack_panel` (two registers of lanes a row; 16 columns on the portable path),
// PANEL_ROWS rows of A each broadcast one value at a time, all PANEL_ROWS x PANEL sums in registers.
// c[i * PANEL + j] (+)= sum_kk a[i][kk] * b[kk * PANEL + j] in order of kk, one fused multiply-add per
// term on every path (std::fma in the portable loop), from zero or (`more`) from c's sums of earlier
// columns of A: a sum's value never depends on its slot, its neighbours or the K blocking.
#if defined(__AVX512F__)
constexpr int64_t PANEL = 32;
constexpr int64_t PANEL_ROWS = 8;      // 16 sums, the panel's row and a broadcast in 32 registers
#else
constexpr int64_t PANEL = 16;
constexpr int64_t PANEL_ROWS = 6;      // 12 sums, the panel's row and a broadcast in AVX2's 16
#endif

#if defined(__AVX2__) && defined(__FMA__)
// rows j0..j0+7 (null: zeros), columns k..k+7, as 8 columns of 8: one 8 x 8 transpose in registers
template <typename W>
inline void pack_block8(const W* const* rows, int64_t k, float* b) {
    __m256 r[8];
    for (int i = 0; i < 8; ++i) r[i] = rows[i] ? load256(rows[i] + k) : _mm256_setzero_ps();
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int c = 0; c < 4; ++c) {
        _mm256_storeu_ps(b + (k + c) * PANEL, _mm256_permute2f128_ps(u[c], u[c + 4], 0x20));
        _mm256_storeu_ps(b + (k + c + 4) * PANEL, _mm256_permute2f128_ps(u[c], u[c + 4], 0x31));
    }
}
#endif

// b[kk * PANEL + j] = rows[j][kk] for j < PANEL, kk < K; a null row packs as zeros (a short panel).
// Rows of float32 or bfloat16 (`bf16_t`, widened as they are packed)
template <typename W>
inline void pack_panel(const W* const rows[PANEL], int64_t K, float* b) {
#if defined(__AVX2__) && defined(__FMA__)
    // the same copy, 8 x 8 blocks transposed in registers: the scalar loop below stores one value per
    // cache line of `b` in turn, and at a few rows an expert it cost about as much as the products
    if (!portable() && K % 8 == 0) {
        for (int64_t j0 = 0; j0 < PANEL; j0 += 8)
            for (int64_t k = 0; k < K; k += 8) pack_block8(rows + j0, k, b + j0);
        return;
    }
#endif
    for (int64_t j = 0; j < PANEL; ++j) {
        const W* r = rows[j];
        if (r == nullptr) {
            for (int64_t kk = 0; kk < K; ++kk) b[kk * PANEL + j] = 0.f;
        } else {
            for (int64_t kk = 0; kk < K; ++kk) b[kk * PANEL + j] = to_float(r[kk]);
        }
    }
}

// R rows a tile (PANEL_ROWS by default; fewer for a product's last rows, `panels.cpp`)
template <int R = PANEL_ROWS>
inline void panel_tile(const float* const* a, const float* b, int64_t K, float* c, bool more) {
#if defined(OURO_LANES)
    if (!portable()) {
        using L = Lanes;
        constexpr int NV = PANEL / L::W;
        L::T acc[R][NV];
        for (int i = 0; i < R; ++i)
            for (int v = 0; v < NV; ++v) acc[i][v] = more ? L::load(c + i * PANEL + v * L::W) : L::zero();
        for (int64_t kk = 0; kk < K; ++kk) {
            L::T bv[NV];
            for (int v = 0; v < NV; ++v) bv[v] = L::load(b + kk * PANEL + v * L::W);
            for (int i = 0; i < R; ++i) {
                const L::T av = L::set1(a[i][kk]);
                for (int v = 0; v < NV; ++v) acc[i][v] = L::fma(av, bv[v], acc[i][v]);
            }
        }
        for (int i = 0; i < R; ++i)
            for (int v = 0; v < NV; ++v) L::store(c + i * PANEL + v * L::W, acc[i][v]);
        return;
    }
#endif
    for (int i = 0; i < R; ++i)
        for (int64_t j = 0; j < PANEL; ++j) {
            float s = more ? c[i * PANEL + j] : 0.f;
            for (int64_t kk = 0; kk < K; ++kk) s = std::fma(a[i][kk], b[kk * PANEL + j], s);
            c[i * PANEL + j] = s;
        }
}

#if defined(OURO_LANES)
// out[j] = Lanes::sum(acc[j]) for j < 8 (sum_8) or 16 (sum_16), the registers reduced together:
// a transpose-and-add network whose additions per register are exactly Lanes::sum's (lanes i and
// i + W/2, then i + W/4, ... down to neighbours), so each result is bit for bit the one-register
// reduction's, at about a third of its shuffles and adds (which were most of a short dot's cost)
#if defined(__AVX512F__)
// 16 lanes: pairs of registers' halves (distance 8), then quarters (4), then inside each quarter
// (2, 1). Afterwards lane 4c + m of the result holds register 4m + c (sum_16); sum_8's holds
// register c at lane 4c and 4 + c at lane 4c + 1.
inline void sum_halves_quarters(const __m512* acc, int nq, __m512* t) {
    __m512 s[8];
    for (int m = 0; m < 2 * nq; ++m)
        s[m] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * m], acc[2 * m + 1], 0x44),
                             _mm512_shuffle_f32x4(acc[2 * m], acc[2 * m + 1], 0xEE));
    for (int j = 0; j < nq; ++j)
        t[j] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * j], s[2 * j + 1], 0x88),
                             _mm512_shuffle_f32x4(s[2 * j], s[2 * j + 1], 0xDD));
}
inline __m512 pairs_then_neighbours(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 u0 = _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 u1 = _mm512_add_ps(_mm512_shuffle_ps(c, d, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(c, d, _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_ps(u0, u1, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(u0, u1, _MM_SHUFFLE(3, 1, 3, 1)));
}
inline void sum_8(const __m512 acc[8], float out[8]) {
    __m512 t[2];
    sum_halves_quarters(acc, 2, t);
    alignas(64) float v[16];
    _mm512_store_ps(v, pairs_then_neighbours(t[0], t[1], t[0], t[1]));
    for (int c = 0; c < 4; ++c) {
        out[c] = v[4 * c];
        out[4 + c] = v[4 * c + 1];
    }
}
inline void sum_4(const __m512 acc[4], float out[4]) {    // lane 4c holds register c
    __m512 t[1];
    sum_halves_quarters(acc, 1, t);
    alignas(64) float v[16];
    _mm512_store_ps(v, pairs_then_neighbours(t[0], t[0], t[0], t[0]));
    for (int c = 0; c < 4; ++c) out[c] = v[4 * c];
}
inline void sum_16(const __m512 acc[16], float out[16]) {
    __m512 t[4];
    sum_halves_quarters(acc, 4, t);
    alignas(64) float v[16];
    _mm512_store_ps(v, pairs_then_neighbours(t[0], t[1], t[2], t[3]));
    for (int c = 0; c < 4; ++c)
        for (int m = 0; m < 4; ++m) out[4 * m + c] = v[4 * c + m];
}
#else
// 8 lanes: pairs of registers' halves (distance 4), then inside each half (2): t[j] holds the partial
// sums of registers 4j .. 4j + 3 (nt of them); then neighbours (1), giving lane order [0, 2, 4, 6, 1,
// 3, 5, 7] for registers 0 .. 7 of t[0] and t[1] (t[0] twice for four registers: [0, 2, 0, 2, 1, 3, 1, 3])
inline void halves_then_pairs(const __m256* acc, int nt, __m256* t) {
    __m256 s[4];
    for (int m = 0; m < 2 * nt; ++m)
        s[m] = _mm256_add_ps(_mm256_permute2f128_ps(acc[2 * m], acc[2 * m + 1], 0x20),
                             _mm256_permute2f128_ps(acc[2 * m], acc[2 * m + 1], 0x31));
    for (int j = 0; j < nt; ++j)
        t[j] = _mm256_add_ps(_mm256_shuffle_ps(s[2 * j], s[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(s[2 * j], s[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
}
inline __m256 neighbours(__m256 a, __m256 b) {
    return _mm256_add_ps(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}
static constexpr int LANE_OF[8] = {0, 4, 1, 5, 2, 6, 3, 7};      // register j's lane
inline void sum_8(const __m256 acc[8], float out[8]) {
    __m256 t[2];
    halves_then_pairs(acc, 2, t);
    alignas(32) float v[8];
    _mm256_store_ps(v, neighbours(t[0], t[1]));
    for (int j = 0; j < 8; ++j) out[j] = v[LANE_OF[j]];
}
inline void sum_4(const __m256 acc[4], float out[4]) {
    __m256 t[1];
    halves_then_pairs(acc, 1, t);
    alignas(32) float v[8];
    _mm256_store_ps(v, neighbours(t[0], t[0]));
    for (int j = 0; j < 4; ++j) out[j] = v[LANE_OF[j]];
}
inline void sum_16(const __m256 acc[16], float out[16]) {
    sum_8(acc, out);
    sum_8(acc + 8, out + 8);
}
#endif
#endif

// out[r * K + k] = sum_i a[r][i] * b[k][i] for r < R, k < 4: R rows (2 or 4) against four, R x 4
// independent sums (enough to hide the FMA latency), each row loaded once, the registers reduced
// together (sum_8 / sum_16). Each output is summed in the same order whichever slot it sits in, and
// in the same order for R = 2 and 4, so a caller that always goes through these (padding a short
// group with repeats) gets a row's result independent of its neighbours.
// a's rows may be bfloat16 (`bf16_t`: a bfloat16 model's weights, widened as they are loaded).
template <int R, typename W>
inline void dot_rx4(const W* const a[R], const float* const b[4], int64_t n, float out[R * 4]) {
    static_assert(R == 2 || R == 4, "two or four rows");
    int64_t i = 0;
    float s[R * 4] = {};
#if defined(OURO_LANES)
    if (!portable()) {
        using L = Lanes;
        L::T acc[R * 4];
        for (int k = 0; k < R * 4; ++k) acc[k] = L::zero();
        for (; i + L::W <= n; i += L::W) {
            // every row in a register for all its products: left to itself, GCC folds one side's loads
            // into the FMAs (each row loaded for each product), and the loads, not the FMAs, set the pace
            L::T va[R], vb[4];
            for (int r = 0; r < R; ++r) {
                va[r] = L::load(a[r] + i);
                asm("" : "+v"(va[r]));
            }
            for (int k = 0; k < 4; ++k) {
                vb[k] = L::load(b[k] + i);
                asm("" : "+v"(vb[k]));
            }
            for (int k = 0; k < 4; ++k)
                for (int r = 0; r < R; ++r) acc[r * 4 + k] = L::fma(va[r], vb[k], acc[r * 4 + k]);
        }
        if (R == 2)
            sum_8(acc, s);
        else
            sum_16(acc, s);
    }
#endif
    for (; i < n; ++i)
        for (int r = 0; r < R; ++r)
            for (int k = 0; k < 4; ++k) s[r * 4 + k] = std::fma(to_float(a[r][i]), b[k][i], s[r * 4 + k]);
    for (int k = 0; k < R * 4; ++k) out[k] = s[k];
}

template <typename W>
inline void dot_2x4(const W* const a[2], const float* const b[4], int64_t n, float out[8]) {
    dot_rx4<2>(a, b, n, out);
}

// one row against N (1, 2 or 4) others, each of the N sums in dot_rx4's order exactly (each register
// reduced on its own, as Lanes::sum reduces it, which is sum_4's and sum_8's order too), so a row's results are
// the same bits as in dot_2x4 / dot_4x4 whatever N. One weight row read at a time: a streamed read
// (`experts.cpp`); fewer than four rows load fewer (a decode step's expert has one to three).
template <int N, typename W>
inline void dot_1xn(const W* a, const float* const b[N], int64_t n, float out[N]) {
    static_assert(N == 1 || N == 2 || N == 4, "one, two or four rows");
    int64_t i = 0;
    float s[N] = {};
#if defined(OURO_LANES)
    if (!portable()) {
        using L = Lanes;
        L::T acc[N];
        for (int k = 0; k < N; ++k) acc[k] = L::zero();
        for (; i + L::W <= n; i += L::W) {
            L::T va = L::load(a + i), vb[N];
            asm("" : "+v"(va));
            for (int k = 0; k < N; ++k) {
                vb[k] = L::load(b[k] + i);
                asm("" : "+v"(vb[k]));
            }
            for (int k = 0; k < N; ++k) acc[k] = L::fma(va, vb[k], acc[k]);
        }
        if constexpr (N == 4)
            sum_4(acc, s);
        else
            for (int k = 0; k < N; ++k) s[k] = L::sum(acc[k]);
    }
#endif
    for (; i < n; ++i)
        for (int k = 0; k < N; ++k) s[k] = std::fma(to_float(a[i]), b[k][i], s[k]);
    for (int k = 0; k < N; ++k) out[k] = s[k];
}

template <typename W>
inline void dot_1x4(const W* a, const float* const b[4], int64_t n, float out[4]) {
    dot_1xn<4>(a, b, n, out);
}

template <typename W>
inline void dot_4x4(const W* const a[4], const float* const b[4], int64_t n, float out[16]) {
    dot_rx4<4>(a, b, n, out);
}

// y[j][i] = a[j] * y[j][i] + sum_k c[j][k] * x[k][i] for j < 4, k < m, summed in order of k: four
// weighted sums of the same rows (four heads' softmax weights over one tile of values, each rescaling
// what it summed before), each row loaded once for all four; a sum's order is the same whichever slot
// it sits in. A repeated y[j] (a short group padded with repeats) gets the same value twice.
inline void rescale_lincomb_4(float* const y[4], const float a[4], const float* const c[4], const float* const* x,
                              int64_t m, int64_t n) {
    int64_t i = 0;
#if defined(OURO_LANES)
    if (!portable()) {
        // blocks of two registers per head (eight independent sums hide the FMA latency: at one
        // register a head, AVX-512 kept four and ran at about half rate), then single registers
        i = lincomb_4_lanes<2, true>(y, a, c, x, m, n, 0);
        i = lincomb_4_lanes<1, true>(y, a, c, x, m, n, i);
    }
#endif
    for (; i < n; ++i) {
        float s[4];
        for (int j = 0; j < 4; ++j) s[j] = a[j] * y[j][i];
        for (int64_t k = 0; k < m; ++k)
            for (int j = 0; j < 4; ++j) s[j] += c[j][k] * x[k][i];
        for (int j = 0; j < 4; ++j) y[j][i] = s[j];
    }
}

// y[j][i] = sum_k c[j][k] * x[k][i] for j < 4, k < m (m >= 1): four weighted sums of the same rows
// (float32 or bfloat16, widened as read), each row loaded once for all four. Every y[j][i] has
// `lincomb`'s arithmetic exactly (a product, then one FMA a term in order of k), whichever slot or
// block it falls in; a repeated y[j] (fewer than four outputs) gets the same value twice.
template <typename X>
inline void lincomb_4(float* const y[4], const float* const c[4], const X* const* x, int64_t m, int64_t n) {
    int64_t i = 0;
#if defined(OURO_LANES)
    if (!portable()) {
        i = lincomb_4_lanes<2, false>(y, nullptr, c, x, m, n, 0);
        i = lincomb_4_lanes<1, false>(y, nullptr, c, x, m, n, i);
    }
#endif
    for (; i < n; ++i)
        for (int j = 0; j < 4; ++j) {
            float s = c[j][0] * to_float(x[0][i]);
            for (int64_t k = 1; k < m; ++k) s = std::fma(c[j][k], to_float(x[k][i]), s);
            y[j][i] = s;
        }
}

// Two sweeps over a [rows, n] tile X (row stride ld), the column sums kept in registers across the
// rows (blocks of 4 vectors of columns, then single vectors, then a scalar tail), each y[i] summed in
// row order from zero by the same FMAs whichever block it falls in:
//   rows_scale_tdot:  X[r] *= a[r];      y = sum_r b[r] X[r]
//   rows_rank1_tdot:  X[r] += a[r] u;    y = sum_r b[r] X[r]
// (the gated delta rule's decay-and-recall and update-and-read of a state, `kda.cpp`)
template <bool RANK1>
inline void rows_tdot(float* x, int64_t rows, int64_t n, int64_t ld, const float* a, const float* u, const float* b,
                      float* y) {
    int64_t i = 0;
#if defined(OURO_LANES)
    if (!portable())
        i = rows_tdot_lanes<1, RANK1>(x, rows, n, ld, a, u, b, y, rows_tdot_lanes<4, RANK1>(x, rows, n, ld, a, u, b, y, 0));
#endif
    for (; i < n; ++i) {
        float s = 0.f;
        for (int64_t r = 0; r < rows; ++r) {
            float& v = x[r * ld + i];
            v = RANK1 ? std::fma(a[r], u[i], v) : v * a[r];
            s = std::fma(b[r], v, s);
        }
        y[i] = s;
    }
}

inline void rows_scale_tdot(float* x, int64_t rows, int64_t n, int64_t ld, const float* a, const float* b, float* y) {
    rows_tdot<false>(x, rows, n, ld, a, nullptr, b, y);
}

inline void rows_rank1_tdot(float* x, int64_t rows, int64_t n, int64_t ld, const float* a, const float* u,
                            const float* b, float* y) {
    rows_tdot<true>(x, rows, n, ld, a, u, b, y);
}

}  // namespace ouro
