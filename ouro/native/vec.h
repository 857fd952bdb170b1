// Vector primitives the fused kernels are written in: one AVX-512 body, one AVX2 body and a portable
// loop each, picked at build time by the CPU's flags (-march=native). `portable()` forces the
// portable loops at run time, so the tests check every path this machine can run against the same
// reference. Sums accumulate in lanes (float32), which orders additions differently from torch's
// reductions: results agree to float32 rounding, not bit for bit. A row's result depends only on
// that row (never on how many rows share a call), which keeps deterministic mode batch-invariant.
// The register tiles written in these (several rows against several in one pass) are `tiles.h`,
// included at the end.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace ouro {

inline bool& portable() { static bool on = false; return on; }

// a bfloat16 value's bits (torch's at::BFloat16 storage): the high half of a float32, so widening is exact
using bf16_t = uint16_t;
inline float to_float(float v) { return v; }
inline float to_float(bf16_t v) {
    const uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

std::string isa();

// each family's `<family>_isa(force_portable)` op: force (1) or release (0) the portable loops, -1 reads
inline std::string isa_switch(int64_t force_portable) {
    if (force_portable >= 0) portable() = force_portable != 0;
    return isa();
}

inline std::string isa() {
    if (portable()) return "portable";
#if defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
    return "avx2";
#else
    return "portable";
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

// sum_i a[i] * b[i]: four sums side by side over blocks of lanes (one chain of FMAs waits out each
// one's latency: a 2,048-long row took ~4x the cycles its FMAs need), then a single one over the
// blocks left, added as (s0 + s1) + (s2 + s3) + rest; the order depends on n only, never on the row
inline float dot(const float* a, const float* b, int64_t n) {
    int64_t i = 0;
    float s = 0.f;
    if (!portable()) {
#if defined(__AVX512F__)
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (; i + 64 <= n; i += 64)
            for (int j = 0; j < 4; ++j)
                acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16 * j), _mm512_loadu_ps(b + i + 16 * j), acc[j]);
        __m512 rest = _mm512_setzero_ps();
        for (; i + 16 <= n; i += 16) rest = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), rest);
        s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])), rest));
#elif defined(__AVX2__) && defined(__FMA__)
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (; i + 32 <= n; i += 32)
            for (int j = 0; j < 4; ++j)
                acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8 * j), _mm256_loadu_ps(b + i + 8 * j), acc[j]);
        __m256 rest = _mm256_setzero_ps();
        for (; i + 8 <= n; i += 8) rest = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), rest);
        s = hsum256(_mm256_add_ps(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])), rest));
#endif
    }
    for (; i < n; ++i) s += a[i] * b[i];
    return s;
}

inline float sumsq(const float* a, int64_t n) { return dot(a, a, n); }

// y[i] += alpha * x[i]
inline void axpy(float* y, float alpha, const float* x, int64_t n) {
    int64_t i = 0;
    if (!portable()) {
#if defined(__AVX512F__)
        __m512 va = _mm512_set1_ps(alpha);
        for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
#elif defined(__AVX2__) && defined(__FMA__)
        __m256 va = _mm256_set1_ps(alpha);
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
    }
    for (; i < n; ++i) y[i] += alpha * x[i];
}

// y[i] = x[i] * alpha * w[i]   (a normalised row: x times its per-row scale, then the weight)
inline void scale_mul(float* y, const float* x, float alpha, const float* w, int64_t n) {
    int64_t i = 0;
    if (!portable()) {
#if defined(__AVX512F__)
        __m512 va = _mm512_set1_ps(alpha);
        for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_loadu_ps(w + i), _mm512_mul_ps(_mm512_loadu_ps(x + i), va)));
#elif defined(__AVX2__) && defined(__FMA__)
        __m256 va = _mm256_set1_ps(alpha);
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), va)));
#endif
    }
    for (; i < n; ++i) y[i] = w[i] * (x[i] * alpha);
}

// asks for `bytes` from p to be brought into cache ahead of their use (one request per 64-byte line): a
// streamed weight row a few rows before it is read, so the loads of the row at hand find it there
inline void prefetch(const void* p, int64_t bytes) {
#if defined(__AVX2__) || defined(__AVX512F__)
    const char* c = static_cast<const char*>(p);
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
#else
    (void)p, (void)bytes;
#endif
}

inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }
inline float silu(float x) { return x / (1.f + std::exp(-x)); }

// a register of lanes loaded from float32 or widened from bfloat16 (exact: the bits shifted up)
#if defined(__AVX512F__)
inline __m512 load512(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load512(const bf16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
#endif
#if defined(__AVX2__) && defined(__FMA__)
inline __m256 load256(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load256(const bf16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
#endif

// y[i] = sum_k c[k] * x[k][i] for k < m (m >= 1), summed in order of k: a weighted sum of rows in one
// pass. Rows of float32 or bfloat16 (widened as they are read: the same sums as on the widened rows)
template <typename T>
inline void lincomb(float* y, const float* c, const T* const* x, int64_t m, int64_t n) {
    int64_t i = 0;
    if (!portable()) {
#if defined(__AVX512F__)
        for (; i + 16 <= n; i += 16) {
            __m512 acc = _mm512_mul_ps(_mm512_set1_ps(c[0]), load512(x[0] + i));
            for (int64_t k = 1; k < m; ++k) acc = _mm512_fmadd_ps(_mm512_set1_ps(c[k]), load512(x[k] + i), acc);
            _mm512_storeu_ps(y + i, acc);
        }
#elif defined(__AVX2__) && defined(__FMA__)
        for (; i + 8 <= n; i += 8) {
            __m256 acc = _mm256_mul_ps(_mm256_set1_ps(c[0]), load256(x[0] + i));
            for (int64_t k = 1; k < m; ++k) acc = _mm256_fmadd_ps(_mm256_set1_ps(c[k]), load256(x[k] + i), acc);
            _mm256_storeu_ps(y + i, acc);
        }
#endif
    }
    for (; i < n; ++i) {
        float s = c[0] * to_float(x[0][i]);
        for (int64_t k = 1; k < m; ++k) s = std::fma(c[k], to_float(x[k][i]), s);
        y[i] = s;
    }
}

// y[i] = x[i] widened to float32 (a bfloat16 row into a kernel's float32 scratch)
inline void widen(float* y, const bf16_t* x, int64_t n) {
    int64_t i = 0;
    if (!portable()) {
#if defined(__AVX512F__)
        for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, load512(x + i));
#elif defined(__AVX2__) && defined(__FMA__)
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, load256(x + i));
#endif
    }
    for (; i < n; ++i) y[i] = to_float(x[i]);
}

// float32 -> bfloat16 rounded to nearest, ties to even (torch's `.to(torch.bfloat16)`), a NaN as 0x7FC0
inline bf16_t to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return bf16_t(0x7FC0);
    return bf16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// y[i] = x[i] rounded to bfloat16 (a kernel's float32 result stored into a bfloat16 model's tensor)
inline void narrow(bf16_t* y, const float* x, int64_t n) {
    int64_t i = 0;
    if (!portable()) {
#if defined(__AVX512F__)
        const __m512i half = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1), qnan = _mm512_set1_epi32(0x7FC0);
        for (; i + 16 <= n; i += 16) {
            const __m512 v = _mm512_loadu_ps(x + i);
            const __m512i u = _mm512_castps_si512(v);
            __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(half, _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
            r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_srli_epi32(r, 16), qnan);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i), _mm512_cvtepi32_epi16(r));
        }
#elif defined(__AVX2__) && defined(__FMA__)
        const __m256i half = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1), qnan = _mm256_set1_epi32(0x7FC0);
        for (; i + 8 <= n; i += 8) {
            const __m256 v = _mm256_loadu_ps(x + i);
            const __m256i u = _mm256_castps_si256(v);
            __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(half, _mm256_and_si256(_mm256_srli_epi32(u, 16), one))), 16);
            r = _mm256_blendv_epi8(r, qnan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
            // 32 -> 16 bits: packus works within 128-bit halves, the permute puts the two halves together
            const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
            _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i), _mm256_castsi256_si128(p));
        }
#endif
    }
    for (; i < n; ++i) y[i] = to_bf16(x[i]);
}

// e^x for x <= 0 (sigmoid and silu need only e^-|x|), lane by lane: 2^n times a degree-6 polynomial
// on the remainder (Cephes' expf coefficients), within ~2 ulp. Below -87.3 the result is 0 (torch
// gives denormals under 1e-38 there; e^-inf = 0 keeps silu(-inf) NaN as torch's); NaN stays NaN.
#if defined(__AVX2__) && defined(__FMA__)
inline __m256 exp_nonpos256(__m256 x) {
    const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
    x = _mm256_max_ps(_mm256_set1_ps(-87.3f), x);      // max(lo, NaN) is NaN
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693359375f), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#endif
#if defined(__AVX512F__)
inline __m512 exp_nonpos512(__m512 x) {
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_NLT_UQ);   // NaN kept
    x = _mm512_max_ps(_mm512_set1_ps(-87.3f), x);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(keep, p, _mm512_castsi512_ps(e));
}
#endif

// sigmoid of a register's lanes as e / (1 + e) or 1 / (1 + e) with e = e^-|x|: no overflow
#if defined(__AVX512F__)
inline __m512 sigmoid512(__m512 v) {
    const __m512 one = _mm512_set1_ps(1.f);
    const __m512 e = exp_nonpos512(_mm512_castsi512_ps(
        _mm512_or_si512(_mm512_castps_si512(v), _mm512_set1_epi32(int(0x80000000u)))));
    const __m512 pos = _mm512_div_ps(one, _mm512_add_ps(one, e));
    const __mmask16 ge = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_GE_OQ);   // NaN: not >= 0
    return _mm512_mask_blend_ps(ge, _mm512_mul_ps(e, pos), pos);
}
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256 sigmoid256(__m256 v) {
    const __m256 one = _mm256_set1_ps(1.f);
    const __m256 e = exp_nonpos256(_mm256_or_ps(v, _mm256_set1_ps(-0.f)));
    const __m256 pos = _mm256_div_ps(one, _mm256_add_ps(one, e));
    const __m256 ge = _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_GE_OQ);         // NaN: not >= 0
    return _mm256_blendv_ps(_mm256_mul_ps(e, pos), pos, ge);
}
#endif

// y[i] = Op::apply(x[i]) over a row (y may be x): every value through the same vector arithmetic, a
// short tail padded (masked on AVX-512, a zero-padded buffer on AVX2), so a value's result does not
// depend on where it sits (equal inputs, equal outputs); Op's scalar form on the portable path
template <typename Op>
inline void padded_row(float* y, const float* x, int64_t n) {
    int64_t i = 0;
    if (!portable()) {
#if defined(__AVX512F__)
        for (; i < n; i += 16) {
            const __mmask16 k = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
            _mm512_mask_storeu_ps(y + i, k, Op::apply(_mm512_maskz_loadu_ps(k, x + i)));
        }
#elif defined(__AVX2__) && defined(__FMA__)
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, Op::apply(_mm256_loadu_ps(x + i)));
        if (i < n) {
            float pad[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            for (int64_t j = i; j < n; ++j) pad[j - i] = x[j];
            _mm256_storeu_ps(pad, Op::apply(_mm256_loadu_ps(pad)));
            for (int64_t j = i; j < n; ++j) y[j] = pad[j - i];
            i = n;
        }
#endif
    }
    for (; i < n; ++i) y[i] = Op::apply(x[i]);
}

struct SigmoidOp {
#if defined(__AVX512F__)
    static __m512 apply(__m512 v) { return sigmoid512(v); }
#elif defined(__AVX2__) && defined(__FMA__)
    static __m256 apply(__m256 v) { return sigmoid256(v); }
#endif
    static float apply(float v) { return sigmoid(v); }
};

// y[i] = sigmoid(x[i]) (the router's ties: equal logits, equal scores)
inline void sigmoid_row(float* y, const float* x, int64_t n) { padded_row<SigmoidOp>(y, x, n); }

// out[i] = silu(min(gate[i], lim)) * clamp(up[i], -lim, lim) (ouro.ops.moe.clamped_swiglu; out may not
// alias gate or up), silu as x * sigmoid(x), sigmoid_row's arithmetic lane for lane, in one pass over
// the row (three before: ~1.5 cycles an element at 256 wide). std::min / std::max return their first
// argument when it is NaN, and min_ps / max_ps their second: NaN stays NaN, as in torch's clamp
inline void clamped_swiglu_row(float* out, const float* gate, const float* up, int64_t n, float lim) {
    int64_t i = 0;
    if (!portable()) {
#if defined(__AVX512F__)
        const __m512 hi = _mm512_set1_ps(lim), lo = _mm512_set1_ps(-lim);
        for (; i + 16 <= n; i += 16) {
            const __m512 g = _mm512_min_ps(hi, _mm512_loadu_ps(gate + i));
            const __m512 u = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_loadu_ps(up + i)));
            _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(g, sigmoid512(g)), u));
        }
#elif defined(__AVX2__) && defined(__FMA__)
        const __m256 hi = _mm256_set1_ps(lim), lo = _mm256_set1_ps(-lim);
        for (; i + 8 <= n; i += 8) {
            const __m256 g = _mm256_min_ps(hi, _mm256_loadu_ps(gate + i));
            const __m256 u = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_loadu_ps(up + i)));
            _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid256(g)), u));
        }
#endif
    }
    for (; i < n; ++i) {
        const float g = std::min(gate[i], lim);
        out[i] = g * sigmoid(g) * std::min(std::max(up[i], -lim), lim);
    }
}

struct ExpNonposOp {
#if defined(__AVX512F__)
    static __m512 apply(__m512 v) { return exp_nonpos512(v); }
#elif defined(__AVX2__) && defined(__FMA__)
    static __m256 apply(__m256 v) { return exp_nonpos256(v); }
#endif
    static float apply(float v) { return std::exp(v); }
};

// y[i] = e^x[i] for x[i] <= 0 (softmax weights once the max is subtracted): exp_nonpos's polynomial
// on every lane, std::exp on the portable path
inline void exp_nonpos_row(float* y, const float* x, int64_t n) { padded_row<ExpNonposOp>(y, x, n); }

}  // namespace ouro

#include "tiles.h"   // the register tiles written in these primitives
