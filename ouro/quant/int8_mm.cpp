// W8A8 int8 products: acc[m, n] = sum_k x[m, k] * w[n, k] with x and w in [-127, 127] (symmetric
// quantisation never makes -128). Exact: every partial sum is an integer that fits in int32.
//
// Layout: a weight [N, K] is stored once as [ceil(N/8)][ceil(K/4)][8][4] (`pack_weight`): 32 bytes
// = 8 output channels x 4 consecutive k. An activation row's 4 bytes at k are broadcast to all 8
// lanes, so each lane accumulates its own channel (no horizontal sums), and a tile of R rows x B
// channel blocks keeps R*B accumulators in registers while the weight streams once per tile.
//
// AVX2 (no VNNI): the sign trick. vpmaddubsw multiplies unsigned by signed bytes and adds pairs into
// int16 with saturation; with |x| (unsigned, <= 127) and w * sign(x) (signed, |.| <= 127) a pair is
// at most 2 * 127 * 127 = 32258 < 32767, so it never saturates; vpmaddwd with ones widens the pairs
// into int32. With AVX-VNNI / AVX512-VNNI, vpdpbusd does both in one. Elsewhere: scalar loops.
// Threads split (expert, channel-block groups) with at::parallel_for: torch's own pool.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t ROW_CHUNK = 64;        // rows whose quantised activations stay in L2 while weights stream
constexpr int64_t LANES = 8, KG = 4;      // channels per block, k per group

// a thread's share should be worth waking it: at least ~256 KB of weights
int64_t grain_for(int64_t K) { return std::max<int64_t>(1, (int64_t(1) << 18) / std::max<int64_t>(1, K)); }

// per-row symmetric quantisation, the same arithmetic as ouro.ops.quant.quantize_rows:
// scale = amax / 127 (float32), q = round-half-even(x / max(scale, FLT_MIN)) clamped to [-127, 127];
// rows written with stride `qs` (>= K; the padding stays as the caller zeroed it)
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q, int64_t qs, float* scale) {
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
                q[m * qs + k] = static_cast<int8_t>(std::isnan(v) ? 0.f : v);
            }
        }
    });
}

#if defined(__AVX2__)
inline __m256i dot4(__m256i acc, __m256i ax, __m256i xb, __m256i w) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, ax, _mm256_sign_epi8(w, xb));
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, ax, _mm256_sign_epi8(w, xb));
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w, xb)),
                                                   _mm256_set1_epi16(1)));
#endif
}
#endif

// rows X[0..R) (int8, stride xs, K padded to K4*4 with zeros) x channel blocks nb0..nb0+B of P;
// out[r][b][j]: the int32 sum of channel (nb0 + b) * 8 + j
template <int R, int B>
inline void packed_tile(const int8_t* X, int64_t xs, const int8_t* P, int64_t K4, int64_t nb0, int32_t out[][B][LANES]) {
#if defined(__AVX2__)
    __m256i acc[R][B];
    for (int r = 0; r < R; ++r)
        for (int b = 0; b < B; ++b) acc[r][b] = _mm256_setzero_si256();
    const int8_t* pb[B];
    for (int b = 0; b < B; ++b) pb[b] = P + (nb0 + b) * K4 * LANES * KG;
    for (int64_t k4 = 0; k4 < K4; ++k4) {
        __m256i w[B];
        for (int b = 0; b < B; ++b) w[b] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb[b] + k4 * LANES * KG));
        for (int r = 0; r < R; ++r) {
            int32_t four;
            std::memcpy(&four, X + r * xs + k4 * KG, 4);
            const __m256i xb = _mm256_set1_epi32(four);
            const __m256i ax = _mm256_sign_epi8(xb, xb);
            for (int b = 0; b < B; ++b) acc[r][b] = dot4(acc[r][b], ax, xb, w[b]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int b = 0; b < B; ++b) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[r][b]), acc[r][b]);
#else
    for (int r = 0; r < R; ++r)
        for (int b = 0; b < B; ++b)
            for (int64_t j = 0; j < LANES; ++j) {
                int32_t s = 0;
                const int8_t* pw = P + (nb0 + b) * K4 * LANES * KG + j * KG;
                for (int64_t k4 = 0; k4 < K4; ++k4)
                    for (int64_t t = 0; t < KG; ++t)
                        s += int32_t(X[r * xs + k4 * KG + t]) * int32_t(pw[k4 * LANES * KG + t]);
                out[r][b][j] = s;
            }
#endif
}

// rows [r0, r1) of X against channel blocks [nbA, nbB) of one packed weight P; emit(m, n, acc), n < N
template <typename Emit>
void packed_rows(const int8_t* X, int64_t xs, const int8_t* P, int64_t K4, int64_t N, int64_t r0, int64_t r1,
                 int64_t nbA, int64_t nbB, Emit emit) {
    constexpr int B = 2;
    int32_t out[4][B][LANES];
    auto put = [&](int64_t m, int rows, int64_t nb0, int blocks) {
        for (int r = 0; r < rows; ++r)
            for (int b = 0; b < blocks; ++b)
                for (int64_t j = 0; j < LANES; ++j) {
                    const int64_t n = (nb0 + b) * LANES + j;
                    if (n < N) emit(m + r, n, out[r][b][j]);
                }
    };
    for (int64_t c0 = r0; c0 < r1; c0 += ROW_CHUNK) {
        const int64_t c1 = std::min(r1, c0 + ROW_CHUNK);
        int64_t nb = nbA;
        for (; nb + B <= nbB; nb += B) {
            int64_t m = c0;
            for (; m + 4 <= c1; m += 4) {
                packed_tile<4, B>(X + m * xs, xs, P, K4, nb, out);
                put(m, 4, nb, B);
            }
            for (; m < c1; ++m) {
                packed_tile<1, B>(X + m * xs, xs, P, K4, nb, out);
                put(m, 1, nb, B);
            }
        }
        for (; nb < nbB; ++nb)
            for (int64_t m = c0; m < c1; ++m) {
                int32_t one[1][1][LANES];
                packed_tile<1, 1>(X + m * xs, xs, P, K4, nb, one);
                for (int64_t j = 0; j < LANES; ++j)
                    if (nb * LANES + j < N) emit(m, nb * LANES + j, one[0][0][j]);
            }
    }
}

// every (expert, group of channel blocks, chunk of ROW_CHUNK rows) with rows, split over torch's
// threads: a decode step splits the channels, a prefill the rows as well (a 512-channel weight is
// one group, and a 2,048-row prefill through it ran on one thread before)
template <typename Emit>
void grouped(const int8_t* X, int64_t xs, const int8_t* P, int64_t E, int64_t NB, int64_t K4, int64_t N,
             const int64_t* off, Emit emit) {
    const int64_t per = std::max<int64_t>(2, grain_for(K4 * KG) / LANES / 2 * 2);
    const int64_t groups = (NB + per - 1) / per;
    struct Item { int64_t e, g, r0, r1; };
    std::vector<Item> items;
    for (int64_t e = 0; e < E; ++e)
        for (int64_t r0 = off[e]; r0 < off[e + 1]; r0 += ROW_CHUNK)
            for (int64_t g = 0; g < groups; ++g) items.push_back({e, g, r0, std::min(off[e + 1], r0 + ROW_CHUNK)});
    at::parallel_for(0, int64_t(items.size()), 1, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
            const Item& it = items[i];
            packed_rows(X, xs, P + it.e * NB * K4 * LANES * KG, K4, N, it.r0, it.r1, it.g * per,
                        std::min(NB, (it.g + 1) * per), [&](int64_t m, int64_t n, int32_t a) { emit(it.e, m, n, a); });
        }
    });
}

void check_offsets(const torch::Tensor& offsets, int64_t E, int64_t R) {
    TORCH_CHECK(offsets.scalar_type() == torch::kLong && offsets.dim() == 1 && offsets.size(0) == E + 1,
                "ouro int8: offsets must be int64 [E + 1]");
    const int64_t* off = offsets.data_ptr<int64_t>();
    TORCH_CHECK(off[0] == 0 && off[E] == R, "ouro int8: offsets must run from 0 to the row count");
    for (int64_t e = 0; e < E; ++e) TORCH_CHECK(off[e] <= off[e + 1], "ouro int8: offsets must not decrease");
}

}  // namespace

// int8 w [E, N, K] -> the packed layout [E, ceil(N/8), ceil(K/4), 8, 4] (zeros past N and K)
torch::Tensor pack_weight(torch::Tensor w) {
    TORCH_CHECK(w.dim() == 3 && w.scalar_type() == torch::kChar && w.device().is_cpu(), "pack_weight: int8 CPU [E, N, K]");
    w = w.contiguous();
    const int64_t E = w.size(0), N = w.size(1), K = w.size(2), NB = (N + LANES - 1) / LANES, K4 = (K + KG - 1) / KG;
    auto p = torch::zeros({E, NB, K4, LANES, KG}, w.options());
    const int8_t* W = w.data_ptr<int8_t>();
    int8_t* P = p.data_ptr<int8_t>();
    for (int64_t e = 0; e < E; ++e)
        for (int64_t n = 0; n < N; ++n)
            for (int64_t k = 0; k < K; ++k)
                P[(((e * NB + n / LANES) * K4 + k / KG) * LANES + n % LANES) * KG + k % KG] = W[(e * N + n) * K + k];
    return p;
}

// W8A8 on packed weights: rows offsets[e] .. offsets[e+1] of x (float32 [R, K]) are quantised per
// row and run through expert e (one expert: a plain projection); N is the real channel count.
// out = float(acc) * x_scale[m] * w_scale[e][n], the reference's order of operations
torch::Tensor w8a8_packed(torch::Tensor x, torch::Tensor p, torch::Tensor w_scale, torch::Tensor offsets, int64_t N) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.device().is_cpu(), "w8a8_packed: float32 CPU x [R, K]");
    TORCH_CHECK(p.dim() == 5 && p.scalar_type() == torch::kChar && p.size(3) == LANES && p.size(4) == KG,
                "w8a8_packed: the weight must come from pack_weight");
    const int64_t R = x.size(0), K = x.size(1), E = p.size(0), NB = p.size(1), K4 = p.size(2);
    TORCH_CHECK(K4 == (K + KG - 1) / KG && NB == (N + LANES - 1) / LANES, "w8a8_packed: x has ", K,
                " columns and N is ", N, ", but the packed weight was made for another shape");
    TORCH_CHECK(w_scale.scalar_type() == torch::kFloat && w_scale.numel() == E * N, "w8a8_packed: float32 w_scale [E, N]");
    offsets = offsets.contiguous();
    check_offsets(offsets, E, R);
    x = x.contiguous();
    w_scale = w_scale.contiguous();
    p = p.contiguous();
    const int64_t xs = K4 * KG;
    auto q = torch::zeros({R, xs}, x.options().dtype(torch::kChar));
    auto sc = torch::empty({R}, x.options());
    quantize_rows(x.data_ptr<float>(), R, K, q.data_ptr<int8_t>(), xs, sc.data_ptr<float>());
    auto out = torch::empty({R, N}, x.options());
    const float* XS = sc.data_ptr<float>();
    const float* WS = w_scale.data_ptr<float>();
    float* Y = out.data_ptr<float>();
    grouped(q.data_ptr<int8_t>(), xs, p.data_ptr<int8_t>(), E, NB, K4, N, offsets.data_ptr<int64_t>(),
            [&](int64_t e, int64_t m, int64_t n, int32_t a) { Y[m * N + n] = float(a) * XS[m] * WS[e * N + n]; });
    return out;
}

// int8 x [M, K] @ int8 w [N, K].T -> exact int32 [M, N] through the same kernel (packs w on every
// call: for checking the kernel, and for callers without a packed copy)
torch::Tensor int8_mm(torch::Tensor x, torch::Tensor w) {
    TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.scalar_type() == torch::kChar && w.scalar_type() == torch::kChar,
                "int8_mm: int8 x [M, K] and w [N, K]");
    TORCH_CHECK(x.size(1) == w.size(1), "int8_mm: x has ", x.size(1), " columns, w has ", w.size(1));
    const int64_t M = x.size(0), K = x.size(1), N = w.size(0), K4 = (K + KG - 1) / KG, NB = (N + LANES - 1) / LANES;
    auto p = pack_weight(w.unsqueeze(0));
    auto q = torch::zeros({M, K4 * KG}, x.options());
    q.narrow(1, 0, K).copy_(x);
    auto out = torch::empty({M, N}, x.options().dtype(torch::kInt));
    auto offsets = torch::tensor({int64_t(0), M}, torch::kLong);
    int32_t* Y = out.data_ptr<int32_t>();
    grouped(q.data_ptr<int8_t>(), K4 * KG, p.data_ptr<int8_t>(), 1, NB, K4, N, offsets.data_ptr<int64_t>(),
            [&](int64_t, int64_t m, int64_t n, int32_t a) { Y[m * N + n] = a; });
    return out;
}

std::string features() {
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
    return "avx2+vnni";
#elif defined(__AVX2__)
    return "avx2";
#else
    return "scalar";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("pack_weight", &pack_weight, "int8 w [E, N, K] -> the packed layout w8a8_packed runs");
    m.def("w8a8_packed", &w8a8_packed, "float32 x [R, K], packed w, float32 w_scale [E, N], int64 offsets [E+1], N");
    m.def("int8_mm", &int8_mm, "int8 [M, K] x int8 [N, K] -> int32 [M, N] (x @ w.T), exact");
    m.def("features", &features, "the instruction set this build uses");
}
