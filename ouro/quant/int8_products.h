// The int8 product kernel of `int8_mm.cpp` (its text says how the layout and the tiles work):
// row quantisation, the packed tile, rows against channel blocks, and the grouped sweep over
// experts that every public op of the file runs.
#pragma once

#include <ATen/Parallel.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <array>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <vector>

#include "vec.h"   // ouro::prefetch

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define OURO_VNNI 1
#endif
#if defined(OURO_VNNI) && defined(__AVX512VNNI__) && defined(__AVX512F__) && !defined(OURO_NO_512)
#define OURO_VNNI512 1            // two channel blocks a 512-bit register (OURO_NO_512: the 256-bit path)
#endif

namespace {

#if defined(__AVX2__) && !defined(OURO_VNNI)
#define OURO_WIDE 1
constexpr int64_t KG = 2;                 // k per group: two int16 products per 32-bit lane
using XT = int16_t;                       // quantised activations as int16
#elif defined(OURO_VNNI)
constexpr int64_t KG = 4;                 // k per group: four int8 products per 32-bit lane
// vpdpbusd multiplies unsigned by signed bytes: activations are kept as x + 128 (1..255) and each
// channel's sum of weights x 128, packed after its block's groups, is taken off the int32 sums
// (exact: the same integers as sum x * w, wrapping alike). The sign trick it replaces
// (|x| x w * sign(x)) cost one more instruction per register product.
using XT = uint8_t;
constexpr int XOFF = 128;
#else
constexpr int64_t KG = 4;                 // k per group: four int8 products per 32-bit lane
using XT = int8_t;
#endif
#if !defined(OURO_VNNI)
constexpr int XOFF = 0;
#endif
// groups a packed block holds past its K groups: the VNNI path's channel corrections (8 int32, one group)
constexpr int64_t EXTRA_GROUPS = XOFF ? 1 : 0;
constexpr int64_t ROW_CHUNK = 32;        // rows whose quantised activations stay in L2 while weights stream
constexpr int64_t LANES = 8;              // channels per block

// A projection's quantised rows and their scales (`w8a8_packed`). Up to KEEP_BYTES a buffer, a decode
// step's sizes, they live in storage the calling thread keeps from call to call: such a call allocates
// nothing but its output (two tensors and a zero-fill fewer: 1-4% a call at 1-64 rows,
// `benchmarks/int8_ab.py` against the previous build, AVX2 Zen 3). Larger ones are tensors freed
// with the call. A row's padding past K is left as it was: it meets the packed weight's zeros
// (`pack_weight`), so whatever it holds adds nothing. The routed experts' op keeps its own fresh
// buffers: kept (or not zero-filled) ones made it 3-8% slower at 16 tokens in the same comparison.
class CallBuffers {
  public:
    static constexpr size_t KEEP_BYTES = size_t(1) << 16;
    static constexpr int SLOTS = 2;
    static constexpr size_t ALIGN = 64;    // a cache line, as a tensor's storage

    // `count` values of T in slot `slot` (each slot one buffer of the call; contents undefined)
    template <typename T>
    T* get(int slot, int64_t count) {
        const size_t bytes = std::max<int64_t>(count, 1) * sizeof(T);
        if (bytes > KEEP_BYTES) {
            owned_.push_back(at::empty({int64_t(bytes)}, at::kByte));
            return reinterpret_cast<T*>(owned_.back().data_ptr());
        }
        std::vector<char>& v = kept()[slot];
        if (v.size() < bytes + ALIGN) v.resize(bytes + ALIGN);
        const uintptr_t at = reinterpret_cast<uintptr_t>(v.data());
        return reinterpret_cast<T*>((at + ALIGN - 1) / ALIGN * ALIGN);
    }

  private:
    static std::array<std::vector<char>, SLOTS>& kept() {
        thread_local std::array<std::vector<char>, SLOTS> k;
        return k;
    }
    std::vector<at::Tensor> owned_;
};

// a thread's share should be worth waking it: at least ~64 KB of weights. A decode step streams its
// weights from memory, not cache (a model is larger than L3), where one thread reads ~8 GB/s and two
// ~13-20: a 512 x 512 weight read cold took 31-33 us on one thread, 20 us split (AVX2 Zen 3; 256 KB
// was the grain before, measured on weights that stayed in cache, where a split bought nothing)
int64_t grain_for(int64_t K) { return std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, K)); }

// per-row symmetric quantisation, the same arithmetic as ouro.ops.quant.quantize_rows:
// scale = amax / 127 (float32), q = round-half-even(x / max(scale, FLT_MIN)) clamped to [-127, 127]
// (NaN -> 0, the row's scale NaN); one row of K values into `out` (its padding past K untouched),
// as the kernel's activation type (XT, `off` added: XOFF) or as int8 (`quantize_int8`, off 0)
template <typename OT>
inline void quantize_row(const float* row, int64_t K, OT* out, float* scale, int off = 0) {
    float amax = 0.f;
    bool nan = false;
    int64_t k = 0;
#if defined(__AVX2__)
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 vmax = _mm256_setzero_ps(), vnan = _mm256_setzero_ps();
    for (; k + 8 <= K; k += 8) {
        const __m256 v = _mm256_and_ps(_mm256_loadu_ps(row + k), absmask);
        vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        vmax = _mm256_max_ps(vmax, v);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmax);
    for (float l : lanes) amax = l > amax ? l : amax;
    nan = _mm256_movemask_ps(vnan) != 0;
#endif
    for (; k < K; ++k) {
        const float a = std::fabs(row[k]);
        nan |= std::isnan(a);
        amax = a > amax ? a : amax;
    }
    const float s = nan ? NAN : amax / 127.f;
    *scale = s;
    const float d = s > FLT_MIN ? s : FLT_MIN;
    k = 0;
#if defined(__AVX2__)
    const __m256 vd = _mm256_set1_ps(d), hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
    for (; k + 8 <= K; k += 8) {
        const __m256 v = _mm256_loadu_ps(row + k);
        __m256 r = _mm256_round_ps(_mm256_div_ps(v, vd), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r = _mm256_min_ps(_mm256_max_ps(r, lo), hi);                       // NaN -> lo (max returns its 2nd)
        r = _mm256_andnot_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q), r);        // NaN inputs -> 0
        alignas(32) int32_t iv[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(iv), _mm256_cvtps_epi32(r));
        for (int j = 0; j < 8; ++j) out[k + j] = static_cast<OT>(iv[j] + off);
    }
#endif
    for (; k < K; ++k) {
        float v = std::nearbyint(row[k] / d);
        v = v > 127.f ? 127.f : (v < -127.f ? -127.f : v);
        out[k] = static_cast<OT>(static_cast<int>(std::isnan(v) ? 0.f : v) + off);
    }
}

// M rows of K (x: row stride xs >= K) written with stride `qs` (>= K; the padding past K is not written)
template <typename OT>
void quantize_rows(const float* x, int64_t xs, int64_t M, int64_t K, OT* q, int64_t qs, float* scale, int off = 0) {
    at::parallel_for(0, M, std::max<int64_t>(1, 4096 / std::max<int64_t>(1, K)), [&](int64_t m0, int64_t m1) {
        for (int64_t m = m0; m < m1; ++m) quantize_row(x + m * xs, K, q + m * qs, scale + m, off);
    });
}

// bytes of one packed channel block: its KGN groups and its corrections
inline int64_t block_bytes(int64_t KGN) { return (KGN + EXTRA_GROUPS) * LANES * KG; }

#if defined(OURO_VNNI)
// acc + the four (x + 128) x w byte products of each lane
inline __m256i dot4(__m256i acc, __m256i xb, __m256i w) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, xb, w);
#else
    return _mm256_dpbusd_avx_epi32(acc, xb, w);
#endif
}
#endif

// rows X[0..R) (stride xs, K padded to K_G*KG with zeros) x channel blocks nb0..nb0+B of P;
// out[r][b][j]: the int32 sum of channel (nb0 + b) * 8 + j
template <int R, int B>
inline void packed_tile(const XT* X, int64_t xs, const int8_t* P, int64_t KGN, int64_t nb0, int32_t out[][B][LANES]) {
    const int8_t* pb[B];
    for (int b = 0; b < B; ++b) pb[b] = P + (nb0 + b) * block_bytes(KGN);
#if defined(OURO_VNNI512)
    if constexpr (B % 2 == 0) {        // blocks b and b + 1 side by side in one register
        constexpr int H = B / 2;
        __m512i acc[R][H];
        for (int r = 0; r < R; ++r)
            for (int h = 0; h < H; ++h) acc[r][h] = _mm512_setzero_si512();
        auto pair = [&](int h, int64_t at) {
            return _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb[2 * h] + at))),
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb[2 * h + 1] + at)), 1);
        };
        for (int64_t g = 0; g < KGN; ++g) {
            __m512i w[H];
            for (int h = 0; h < H; ++h) w[h] = pair(h, g * LANES * KG);
            for (int r = 0; r < R; ++r) {
                int32_t four;
                std::memcpy(&four, X + r * xs + g * KG, 4);
                const __m512i xb = _mm512_set1_epi32(four);
                for (int h = 0; h < H; ++h) acc[r][h] = _mm512_dpbusd_epi32(acc[r][h], xb, w[h]);
            }
        }
        for (int h = 0; h < H; ++h) {
            const __m512i corr = pair(h, KGN * LANES * KG);
            for (int r = 0; r < R; ++r)
                _mm512_storeu_si512(reinterpret_cast<__m512i*>(out[r][2 * h]), _mm512_sub_epi32(acc[r][h], corr));
        }
        return;
    }
#endif
#if defined(OURO_WIDE)
    __m256i acc[R][B];
    for (int r = 0; r < R; ++r)
        for (int b = 0; b < B; ++b) acc[r][b] = _mm256_setzero_si256();
    for (int64_t g = 0; g < KGN; ++g) {
        __m256i w[B];
        for (int b = 0; b < B; ++b)
            w[b] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pb[b] + g * LANES * KG)));
        for (int r = 0; r < R; ++r) {
            int32_t two;
            std::memcpy(&two, X + r * xs + g * KG, 4);
            const __m256i xb = _mm256_set1_epi32(two);
            for (int b = 0; b < B; ++b) acc[r][b] = _mm256_add_epi32(acc[r][b], _mm256_madd_epi16(xb, w[b]));
        }
    }
    for (int r = 0; r < R; ++r)
        for (int b = 0; b < B; ++b) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[r][b]), acc[r][b]);
#elif defined(OURO_VNNI)
    __m256i acc[R][B];
    for (int r = 0; r < R; ++r)
        for (int b = 0; b < B; ++b) acc[r][b] = _mm256_setzero_si256();
    for (int64_t g = 0; g < KGN; ++g) {
        __m256i w[B];
        for (int b = 0; b < B; ++b) w[b] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb[b] + g * LANES * KG));
        for (int r = 0; r < R; ++r) {
            int32_t four;
            std::memcpy(&four, X + r * xs + g * KG, 4);
            const __m256i xb = _mm256_set1_epi32(four);
            for (int b = 0; b < B; ++b) acc[r][b] = dot4(acc[r][b], xb, w[b]);
        }
    }
    for (int b = 0; b < B; ++b) {
        const __m256i corr = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb[b] + KGN * LANES * KG));
        for (int r = 0; r < R; ++r)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[r][b]), _mm256_sub_epi32(acc[r][b], corr));
    }
#else
    for (int r = 0; r < R; ++r)
        for (int b = 0; b < B; ++b)
            for (int64_t j = 0; j < LANES; ++j) {
                int32_t s = 0;
                const int8_t* pw = pb[b] + j * KG;
                for (int64_t g = 0; g < KGN; ++g)
                    for (int64_t t = 0; t < KG; ++t)
                        s += int32_t(X[r * xs + g * KG + t]) * int32_t(pw[g * LANES * KG + t]);
                out[r][b][j] = s;
            }
#endif
}

// tile shape: TR rows x TB channel blocks of accumulators (16 ymm registers hold TR*TB + TB + 1; with
// 512-bit registers two blocks share one, and 32 of them hold 4 x 2 pairs)
#if defined(OURO_VNNI512)
constexpr int TR = 4, TB = 4;
#else
constexpr int TR = 4, TB = 2;
#endif

// A chunk of at most this many rows (a decode step's rows of one expert, or of a small batch) runs
// one channel block at a time: each thread then reads its weights as one sequential stream, which
// the hardware prefetcher follows. Four blocks at once (four streams 4 KB apart, with the software
// prefetch below) read ~20 GB/s of weights on the Zen 4 VM, where a plain read runs ~30: the routed
// experts of a 16-token step (7 layers, 79 MB) took 5.7 -> 3.4 ms (medians; 0.96 -> 0.65-0.74 ms at
// one token; the AVX2 path built on the same machine: 4.4-5.0 -> 3.1-3.3 ms); at 4 rows and more the
// wide tiles' reuse of each load wins again. The sums are the same integers either way.
constexpr int64_t FEW_ROWS = 3;

// rows [r0, r1) of X against channel blocks [nbA, nbB) of one packed weight P;
// emit(m, n0, acc, count): the int32 sums of channels n0 .. n0 + count (count <= 8, n0 + count <= N)
template <typename Emit>
void packed_rows(const XT* X, int64_t xs, const int8_t* P, int64_t KGN, int64_t N, int64_t r0, int64_t r1,
                 int64_t nbA, int64_t nbB, Emit emit) {
    int32_t out[TR][TB][LANES];
    auto put = [&](int64_t m, int rows, int64_t nb0, int blocks, int32_t (*o)[TB][LANES]) {
        for (int r = 0; r < rows; ++r)
            for (int b = 0; b < blocks; ++b) {
                const int64_t n0 = (nb0 + b) * LANES;
                emit(m + r, n0, o[r][b], std::min<int64_t>(LANES, N - n0));
            }
    };
    for (int64_t c0 = r0; c0 < r1; c0 += ROW_CHUNK) {
        const int64_t c1 = std::min(r1, c0 + ROW_CHUNK);
        int64_t nb = nbA;
        if (c1 - c0 <= FEW_ROWS) {
            int32_t few[2][1][LANES];
            for (; nb < nbB; ++nb) {
                const int64_t n0 = nb * LANES, count = std::min<int64_t>(LANES, N - n0);
                int64_t m = c0;
                for (; m + 2 <= c1; m += 2) {
                    packed_tile<2, 1>(X + m * xs, xs, P, KGN, nb, few);
                    emit(m, n0, few[0][0], count);
                    emit(m + 1, n0, few[1][0], count);
                }
                if (m < c1) {
                    packed_tile<1, 1>(X + m * xs, xs, P, KGN, nb, few);
                    emit(m, n0, few[0][0], count);
                }
            }
            continue;
        }
        for (; nb + TB <= nbB; nb += TB) {
            // the next tile's blocks requested while this one is summed (streamed weights: measured on
            // the float experts, 1.2-1.35x a cold 16-token step's routed experts)
            if (c0 == r0 && nb + 2 * TB <= nbB) ouro::prefetch(P + (nb + TB) * block_bytes(KGN), TB * block_bytes(KGN));
            int64_t m = c0;
            for (; m + TR <= c1; m += TR) {
                packed_tile<TR, TB>(X + m * xs, xs, P, KGN, nb, out);
                put(m, TR, nb, TB, out);
            }
            for (; m + 2 <= c1; m += 2) {     // a decode step's few rows an expert: each weight load serves two
                packed_tile<2, TB>(X + m * xs, xs, P, KGN, nb, out);
                put(m, 2, nb, TB, out);
            }
            for (; m < c1; ++m) {
                packed_tile<1, TB>(X + m * xs, xs, P, KGN, nb, out);
                put(m, 1, nb, TB, out);
            }
        }
        for (; nb < nbB; ++nb)
            for (int64_t m = c0; m < c1; ++m) {
                int32_t one[1][1][LANES];
                packed_tile<1, 1>(X + m * xs, xs, P, KGN, nb, one);
                emit(m, nb * LANES, one[0][0], std::min<int64_t>(LANES, N - nb * LANES));
            }
    }
}

// every (expert, group of channel blocks, chunk of ROW_CHUNK rows) with rows, split over torch's
// threads: a decode step splits the channels, a prefill the rows as well (a 512-channel weight is
// one group, and a 2,048-row prefill through it ran on one thread before)
template <typename Emit>
void grouped(const XT* X, int64_t xs, const int8_t* P, int64_t E, int64_t NB, int64_t KGN, int64_t N,
             const int64_t* off, Emit emit) {
    const int64_t per = std::max<int64_t>(TB, grain_for(KGN * KG) / LANES / TB * TB);
    const int64_t groups = (NB + per - 1) / per;
    struct Item { int64_t e, g, r0, r1; };
    std::vector<Item> items;
    for (int64_t e = 0; e < E; ++e)
        for (int64_t r0 = off[e]; r0 < off[e + 1]; r0 += ROW_CHUNK)
            for (int64_t g = 0; g < groups; ++g) items.push_back({e, g, r0, std::min(off[e + 1], r0 + ROW_CHUNK)});
    at::parallel_for(0, int64_t(items.size()), 1, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
            const Item& it = items[i];
            packed_rows(X, xs, P + it.e * NB * block_bytes(KGN), KGN, N, it.r0, it.r1, it.g * per,
                        std::min(NB, (it.g + 1) * per),
                        [&](int64_t m, int64_t n0, const int32_t* a, int64_t count) { emit(it.e, m, n0, a, count); });
        }
    });
}
}  // namespace
