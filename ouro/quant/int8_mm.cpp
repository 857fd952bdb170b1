// int8 x int8 -> int32 products for W8A8: acc[m, n] = sum_k x[m, k] * w[n, k], both in [-127, 127]
// (symmetric quantisation never makes -128). Exact: every partial sum is an integer that fits.
//
// AVX2 (no VNNI): the sign trick. vpmaddubsw multiplies unsigned by signed bytes and adds pairs
// into int16 with saturation; with |x| (unsigned, <= 127) and w * sign(x) (signed, |.| <= 127) a
// pair is at most 2 * 127 * 127 = 32258 < 32767, so it never saturates. vpmaddwd with ones then
// widens the pairs into int32 lanes. With AVX-VNNI / AVX512-VNNI, vpdpbusd does both in one.
// Elsewhere: a scalar loop (the compiler vectorises what it can).
//
// Blocking: rows in chunks of ROW_CHUNK (their activations stay in L2), inside that every weight
// row once (kept in L1 while up to 4 activation rows are dotted with it). Threads split the
// output columns (at::parallel_for, torch's own pool: no second OpenMP runtime).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cfloat>
#include <cmath>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t ROW_CHUNK = 64;

#if defined(__AVX2__)
inline __m256i dot32(__m256i acc, __m256i x, __m256i w) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, _mm256_sign_epi8(x, x), _mm256_sign_epi8(w, x));
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, _mm256_sign_epi8(x, x), _mm256_sign_epi8(w, x));
#else
    const __m256i ax = _mm256_sign_epi8(x, x);
    const __m256i sw = _mm256_sign_epi8(w, x);
    const __m256i pairs = _mm256_maddubs_epi16(ax, sw);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

inline int32_t hsum(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}
#endif

inline int32_t dot_tail(const int8_t* x, const int8_t* w, int64_t from, int64_t K) {
    int32_t s = 0;
    for (int64_t k = from; k < K; ++k) s += int32_t(x[k]) * int32_t(w[k]);
    return s;
}

// R (1..4) activation rows against one weight row
template <int R>
inline void dot_rows(const int8_t* const* xs, const int8_t* w, int64_t K, int32_t* out) {
    int64_t k = 0;
#if defined(__AVX2__)
    __m256i acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
    for (; k + 32 <= K; k += 32) {
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k));
        for (int r = 0; r < R; ++r)
            acc[r] = dot32(acc[r], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs[r] + k)), wv);
    }
    for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) + dot_tail(xs[r], w, k, K);
#else
    for (int r = 0; r < R; ++r) out[r] = dot_tail(xs[r], w, 0, K);
#endif
}

// rows [r0, r1) of X (int8 [*, K]) against weight rows [n0, n1) of W (int8 [*, K]); `emit(m, n, acc)`
// takes each exact int32 sum
template <typename Emit>
void block(const int8_t* X, const int8_t* W, int64_t K, int64_t r0, int64_t r1, int64_t n0, int64_t n1, Emit emit) {
    int32_t acc[4];
    for (int64_t c0 = r0; c0 < r1; c0 += ROW_CHUNK) {
        const int64_t c1 = std::min(r1, c0 + ROW_CHUNK);
        for (int64_t n = n0; n < n1; ++n) {
            const int8_t* wn = W + n * K;
            int64_t m = c0;
            for (; m + 4 <= c1; m += 4) {
                const int8_t* xs[4] = {X + m * K, X + (m + 1) * K, X + (m + 2) * K, X + (m + 3) * K};
                dot_rows<4>(xs, wn, K, acc);
                for (int r = 0; r < 4; ++r) emit(m + r, n, acc[r]);
            }
            for (; m < c1; ++m) {
                const int8_t* xs[1] = {X + m * K};
                dot_rows<1>(xs, wn, K, acc);
                emit(m, n, acc[0]);
            }
        }
    }
}

// a thread's share should be worth waking it: at least ~256 KB of weights
int64_t grain_for(int64_t K) { return std::max<int64_t>(1, (int64_t(1) << 18) / std::max<int64_t>(1, K)); }

// per-row symmetric quantisation, the same arithmetic as ouro.ops.quant.quantize_rows:
// scale = amax / 127 (float32), q = round-half-even(x / max(scale, FLT_MIN)) clamped to [-127, 127]
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q, float* scale) {
    at::parallel_for(0, M, std::max<int64_t>(1, 4096 / std::max<int64_t>(1, K)), [&](int64_t m0, int64_t m1) {
        for (int64_t m = m0; m < m1; ++m) {
            const float* row = x + m * K;
            float amax = 0.f;
            bool nan = false;
            for (int64_t k = 0; k < K; ++k) {
                const float a = std::fabs(row[k]);
                nan |= std::isnan(a);
                amax = a > amax ? a : amax;
            }
            const float s = nan ? NAN : amax / 127.f;
            scale[m] = s;
            const float d = s > FLT_MIN ? s : FLT_MIN;
            for (int64_t k = 0; k < K; ++k) {
                float v = std::nearbyint(row[k] / d);
                v = v > 127.f ? 127.f : (v < -127.f ? -127.f : v);
                q[m * K + k] = static_cast<int8_t>(std::isnan(v) ? 0.f : v);
            }
        }
    });
}

void check_int8(const torch::Tensor& x, const torch::Tensor& w, int64_t wdim) {
    TORCH_CHECK(x.dim() == 2 && w.dim() == wdim, "ouro int8: x must be [M, K] and w ", wdim == 2 ? "[N, K]" : "[E, N, K]");
    TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "ouro int8: CPU tensors");
    TORCH_CHECK(w.scalar_type() == torch::kChar, "ouro int8: the weight must be int8");
    TORCH_CHECK(x.size(1) == w.size(wdim - 1), "ouro int8: x has ", x.size(1), " columns, w has ", w.size(wdim - 1));
}

}  // namespace

// int8 x [M, K] @ int8 w [N, K].T -> exact int32 [M, N]
torch::Tensor int8_mm(torch::Tensor x, torch::Tensor w) {
    check_int8(x, w, 2);
    TORCH_CHECK(x.scalar_type() == torch::kChar, "int8_mm: x must be int8");
    x = x.contiguous();
    w = w.contiguous();
    const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
    auto out = torch::empty({M, N}, x.options().dtype(torch::kInt));
    const int8_t* X = x.data_ptr<int8_t>();
    const int8_t* W = w.data_ptr<int8_t>();
    int32_t* Y = out.data_ptr<int32_t>();
    at::parallel_for(0, N, grain_for(K), [&](int64_t n0, int64_t n1) {
        block(X, W, K, 0, M, n0, n1, [&](int64_t m, int64_t n, int32_t a) { Y[m * N + n] = a; });
    });
    return out;
}

// grouped W8A8 (routed experts): rows offsets[e] .. offsets[e+1] of x (float32) are quantised per
// row and run through expert e's weight w[e] [N, K] and scales w_scale[e] [N]; one call for every
// expert; out = acc * x_scale[m] * w_scale[e][n] (the reference's order of operations)
torch::Tensor w8a8_grouped(torch::Tensor x, torch::Tensor w, torch::Tensor w_scale, torch::Tensor offsets) {
    check_int8(x, w, 3);
    TORCH_CHECK(x.scalar_type() == torch::kFloat && w_scale.scalar_type() == torch::kFloat, "w8a8_grouped: float32 x and scales");
    TORCH_CHECK(offsets.scalar_type() == torch::kLong && offsets.dim() == 1 && offsets.size(0) == w.size(0) + 1,
                "w8a8_grouped: offsets must be int64 [E + 1]");
    x = x.contiguous();
    w = w.contiguous();
    w_scale = w_scale.contiguous();
    offsets = offsets.contiguous();
    const int64_t R = x.size(0), K = x.size(1), E = w.size(0), N = w.size(1);
    const int64_t* off = offsets.data_ptr<int64_t>();
    TORCH_CHECK(off[0] == 0 && off[E] == R, "w8a8_grouped: offsets must run from 0 to the row count");
    for (int64_t e = 0; e < E; ++e) TORCH_CHECK(off[e] <= off[e + 1], "w8a8_grouped: offsets must not decrease");
    auto q = torch::empty({R, K}, x.options().dtype(torch::kChar));
    auto xs = torch::empty({R}, x.options());
    quantize_rows(x.data_ptr<float>(), R, K, q.data_ptr<int8_t>(), xs.data_ptr<float>());
    auto out = torch::empty({R, N}, x.options());
    const int8_t* X = q.data_ptr<int8_t>();
    const int8_t* W = w.data_ptr<int8_t>();
    const float* XS = xs.data_ptr<float>();
    const float* WS = w_scale.data_ptr<float>();
    float* Y = out.data_ptr<float>();
    // work items: (expert, block of NB output channels) for the experts that have rows
    const int64_t NB = std::max<int64_t>(1, std::min<int64_t>(N, grain_for(K)));
    const int64_t blocks = (N + NB - 1) / NB;
    std::vector<int64_t> items;
    for (int64_t e = 0; e < E; ++e)
        if (off[e + 1] > off[e])
            for (int64_t b = 0; b < blocks; ++b) items.push_back(e * blocks + b);
    at::parallel_for(0, int64_t(items.size()), 1, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
            const int64_t e = items[i] / blocks, b = items[i] % blocks;
            const int64_t n0 = b * NB, n1 = std::min(N, n0 + NB);
            const float* ws = WS + e * N;
            block(X, W + e * N * K, K, off[e], off[e + 1], n0, n1,
                  [&](int64_t m, int64_t n, int32_t a) { Y[m * N + n] = float(a) * XS[m] * ws[n]; });
        }
    });
    return out;
}


// W8A8 in one call: float32 x [M, K] -> rows quantised -> exact int32 products -> float32 [M, N]
// = acc * x_scale[m] * w_scale[n] (the reference's order of operations); one expert of the grouped form
torch::Tensor w8a8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor w_scale) {
    TORCH_CHECK(w.dim() == 2 && w_scale.dim() == 1, "w8a8_linear: w must be [N, K] and w_scale [N]");
    auto offsets = torch::tensor({int64_t(0), x.size(0)}, torch::kLong);
    return w8a8_grouped(x, w.unsqueeze(0), w_scale.unsqueeze(0), offsets);
}

std::string features() {
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
    return "avx2+vnni";
#elif defined(__AVX2__)
    return "avx2";
#else
    return "scalar";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("int8_mm", &int8_mm, "int8 [M, K] x int8 [N, K] -> int32 [M, N] (x @ w.T), exact");
    m.def("w8a8_linear", &w8a8_linear, "float32 x [M, K], int8 w [N, K], w_scale [N] -> float32 [M, N]");
    m.def("w8a8_grouped", &w8a8_grouped, "float32 x [R, K], int8 w [E, N, K], w_scale [E, N], offsets [E+1]");
    m.def("features", &features, "the instruction set this build uses");
}
