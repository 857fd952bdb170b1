// W8A8 int8 products: acc[m, n] = sum_k x[m, k] * w[n, k] with x and w in [-127, 127] (symmetric
// quantisation never makes -128). Exact: every partial sum is an integer that fits in int32.
//
// Layout: a weight [N, K] is stored once as [ceil(N/8)][ceil(K/KG) (+1 on VNNI)][8][KG] (`pack_weight`): 8 output
// channels x KG consecutive k. An activation row's KG values at k are broadcast to all 8 lanes, so
// each lane accumulates its own channel (no horizontal sums), and a tile of R rows x B channel blocks
// keeps R*B accumulators in registers while the weight streams once per tile.
//
// AVX2 without VNNI: KG = 2 and 16-bit products. Activations are quantised straight into int16; a
// weight block's 16 bytes widen to int16 once per tile step (vpmovsxbw) and vpmaddwd gives 8 lanes
// x 2 products, so each (row, block) costs one multiply and one add per 16 products. The 8-bit form
// (vpmaddubsw) needs unsigned activations: exact 8-bit ones take the sign trick, one more
// instruction on the multiply ports per 32 products, and measured 1.37x slower than fbgemm's 7-bit
// activations; the 16-bit form has fbgemm's multiply count without giving up a bit.
// With AVX-VNNI / AVX512-VNNI: KG = 4, vpdpbusd on activations kept as x + 128 (unsigned), each channel's
// 128 x sum of weights (packed after its block) taken off; with AVX-512 two blocks share a register.
// Elsewhere: scalar loops over the same layout. Threads split (expert, channel-block groups, row
// chunks) with at::parallel_for: torch's own pool.
//
// `w8a8_experts` runs W8A8Experts whole (both products, the clamped SwiGLU between them, the
// weighted sum) in one call: a decode step's routed experts ran as a dozen torch ops and two
// kernel calls per layer before, each call quantising its rows separately.
#include <torch/extension.h>
#include <torch/library.h>

#include "by_expert.h"
#include <ATen/Parallel.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>

#include "int8_products.h"

#if defined(__AVX2__)
// torch's own vectorised e^x (SLEEF, inside libtorch_cpu): the routed experts' SiLU below then has
// torch's bits wherever torch's CPU kernel runs its vector loop. Weak: a torch without the symbol
// leaves it null and the scalar loop (std::exp, torch's loop tail) runs instead.
extern "C" __m256 Sleef_expf8_u10(__m256) __attribute__((weak));
#endif

namespace {

void check_offsets(const torch::Tensor& offsets, int64_t E, int64_t R) {
    TORCH_CHECK(offsets.scalar_type() == torch::kLong && offsets.dim() == 1 && offsets.size(0) == E + 1,
                "ouro int8: offsets must be int64 [E + 1]");
    const int64_t* off = offsets.data_ptr<int64_t>();
    TORCH_CHECK(off[0] == 0 && off[E] == R, "ouro int8: offsets must run from 0 to the row count");
    for (int64_t e = 0; e < E; ++e) TORCH_CHECK(off[e] <= off[e + 1], "ouro int8: offsets must not decrease");
}

at::ScalarType x_dtype() { return sizeof(XT) == 2 ? torch::kShort : XOFF ? torch::kByte : torch::kChar; }

// grouped's emit for a float32 product: y[m][n] = float(acc) * x_scale[m] * w_scale[e][n], the
// reference's order of operations (ouro.ops.quant.dequantize); y and w_scale have N columns
struct Dequantise {
    const float* xs;
    const float* ws;
    float* y;
    int64_t N;
    void operator()(int64_t e, int64_t m, int64_t n0, const int32_t* a, int64_t count) const {
        const float xm = xs[m];
        const float* w = ws + e * N + n0;
        float* out = y + m * N + n0;
        for (int64_t j = 0; j < count; ++j) out[j] = float(a[j]) * xm * w[j];
    }
};

// h = silu(min(gate, lim)) * clamp(up, -lim, lim), ouro.ops.moe.clamped_swiglu's operations in its
// order: only gate's upper side is clamped, up's both; torch's clamp keeps a NaN (so do min_ps and
// max_ps with the value as their 2nd operand, and std::min / std::max with it first); silu(g) =
// g / (1 + e^-g), torch's formula in its vector loop and its tail
inline void swiglu_row(const float* gate, const float* up, int64_t n, float lim, float* h) {
    int64_t i = 0;
#if defined(__AVX2__)
    if (Sleef_expf8_u10 != nullptr) {
        const __m256 hi = _mm256_set1_ps(lim), lo = _mm256_set1_ps(-lim), one = _mm256_set1_ps(1.f);
        const __m256 sign = _mm256_set1_ps(-0.f);
        for (; i < n; i += 8) {
            const int64_t c = std::min<int64_t>(8, n - i);
            alignas(32) float gb[8] = {}, ub[8] = {}, hb[8];
            const float *g = gate + i, *u = up + i;
            if (c < 8) {                    // the tail through the same vector arithmetic
                std::memcpy(gb, g, c * sizeof(float));
                std::memcpy(ub, u, c * sizeof(float));
                g = gb;
                u = ub;
            }
            const __m256 gv = _mm256_min_ps(hi, _mm256_loadu_ps(g));
            const __m256 uv = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_loadu_ps(u)));
            const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(one, Sleef_expf8_u10(_mm256_xor_ps(gv, sign))));
            const __m256 r = _mm256_mul_ps(silu, uv);
            if (c == 8) {
                _mm256_storeu_ps(h + i, r);
            } else {
                _mm256_store_ps(hb, r);
                std::memcpy(h + i, hb, c * sizeof(float));
            }
        }
        return;
    }
#endif
    for (; i < n; ++i) {
        const float g = std::min(gate[i], lim);
        h[i] = g / (1.f + std::exp(-g)) * std::min(std::max(up[i], -lim), lim);
    }
}

// out[d] = sum_j w[j] * rows[j][d] in choice order, each product rounded before its add: torch's
// einsum over a token's k outputs (measured; a multiply fused into its add would round once)
inline void weighted_sum(float* out, const float* w, const float* const* rows, int64_t k, int64_t D) {
    int64_t d = 0;
#if defined(__AVX2__)
    for (; d + 8 <= D; d += 8) {
        __m256 acc = _mm256_mul_ps(_mm256_set1_ps(w[0]), _mm256_loadu_ps(rows[0] + d));
        for (int64_t j = 1; j < k; ++j) {
            __m256 p = _mm256_mul_ps(_mm256_set1_ps(w[j]), _mm256_loadu_ps(rows[j] + d));
            asm("" : "+x"(p));      // the product stays a value: no fused multiply-add
            acc = _mm256_add_ps(acc, p);
        }
        _mm256_storeu_ps(out + d, acc);
    }
#endif
    for (; d < D; ++d) {
        float acc = w[0] * rows[0][d];
        for (int64_t j = 1; j < k; ++j) {
            volatile float p = w[j] * rows[j][d];
            acc = acc + p;
        }
        out[d] = acc;
    }
}

}  // namespace

// int8 w [E, N, K] -> the packed layout [E, ceil(N/8), ceil(K/KG) + EXTRA_GROUPS, 8, KG] (zeros past N
// and K); on the VNNI path each block's last group holds its 8 channels' XOFF x sum of weights (int32)
torch::Tensor pack_weight(torch::Tensor w) {
    TORCH_CHECK(w.dim() == 3 && w.scalar_type() == torch::kChar && w.device().is_cpu(), "pack_weight: int8 CPU [E, N, K]");
    w = w.contiguous();
    const int64_t E = w.size(0), N = w.size(1), K = w.size(2), NB = (N + LANES - 1) / LANES, KGN = (K + KG - 1) / KG;
    const int64_t G = KGN + EXTRA_GROUPS;
    auto p = torch::zeros({E, NB, G, LANES, KG}, w.options());
    const int8_t* W = w.data_ptr<int8_t>();
    int8_t* P = p.data_ptr<int8_t>();
    at::parallel_for(0, E * N, 64, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
            const int64_t e = i / N, n = i % N;
            int32_t sum = 0;
            for (int64_t k = 0; k < K; ++k) {
                P[(((e * NB + n / LANES) * G + k / KG) * LANES + n % LANES) * KG + k % KG] = W[i * K + k];
                sum += W[i * K + k];
            }
            if (EXTRA_GROUPS) {
                const int32_t corr = XOFF * sum;
                std::memcpy(P + ((e * NB + n / LANES) * G + KGN) * LANES * KG + (n % LANES) * 4, &corr, 4);
            }
        }
    });
    return p;
}

// a packed weight's K groups (its groups less the corrections)
int64_t k_groups(const torch::Tensor& p) { return p.size(2) - EXTRA_GROUPS; }

// W8A8 on packed weights: rows offsets[e] .. offsets[e+1] of x (float32 [R, K]) are quantised per
// row and run through expert e (one expert: a plain projection); N is the real channel count.
// out = float(acc) * x_scale[m] * w_scale[e][n], the reference's order of operations
torch::Tensor w8a8_packed(torch::Tensor x, torch::Tensor p, torch::Tensor w_scale, torch::Tensor offsets, int64_t N) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.device().is_cpu(), "w8a8_packed: float32 CPU x [R, K]");
    TORCH_CHECK(p.dim() == 5 && p.scalar_type() == torch::kChar && p.size(3) == LANES && p.size(4) == KG,
                "w8a8_packed: the weight must come from pack_weight");
    const int64_t R = x.size(0), K = x.size(1), E = p.size(0), NB = p.size(1), KGN = k_groups(p);
    TORCH_CHECK(KGN == (K + KG - 1) / KG && NB == (N + LANES - 1) / LANES, "w8a8_packed: x has ", K,
                " columns and N is ", N, ", but the packed weight was made for another shape");
    TORCH_CHECK(w_scale.scalar_type() == torch::kFloat && w_scale.numel() == E * N, "w8a8_packed: float32 w_scale [E, N]");
    // empty offsets: one weight, every row (a projection; no tensor made from the row count per call)
    const int64_t whole[2] = {0, R};
    const int64_t* off = whole;
    if (offsets.numel() != 0 || E != 1) {
        offsets = offsets.contiguous();
        check_offsets(offsets, E, R);
        off = offsets.data_ptr<int64_t>();
    }
    // rows read where they are (a slice of a merged product's output: the KDA's f_a / g_a halves), no copy
    if (x.stride(1) != 1 || (R > 1 && x.stride(0) < K)) x = x.contiguous();
    const int64_t x_rows = R > 1 ? x.stride(0) : K;
    w_scale = w_scale.contiguous();
    p = p.contiguous();
    const int64_t xs = KGN * KG;
    CallBuffers buffers;
    XT* q = buffers.get<XT>(0, R * xs);
    float* sc = buffers.get<float>(1, R);
    quantize_rows(x.data_ptr<float>(), x_rows, R, K, q, xs, sc, XOFF);
    auto out = torch::empty({R, N}, x.options());
    grouped(q, xs, p.data_ptr<int8_t>(), E, NB, KGN, N, off, Dequantise{sc, w_scale.data_ptr<float>(), out.data_ptr<float>(), N});
    return out;
}

// The routed experts of W8A8Experts in one call: x float32 [T, D], each token's k choices (experts
// int64 [T, k], weights float32 [T, k]), gate_up and down packed by pack_weight from int8 [E, 2I, D]
// and [E, D, I] with float32 per-channel scales [E, 2I] and [E, D] -> float32 [T, D]. The eager
// path's steps and arithmetic: the (token, choice) pairs grouped by expert in by_expert's order,
// each row quantised per row, gate_up (exact int32 sums, scaled as w8a8_packed scales them), the
// clamped SwiGLU, h quantised per row, down, and each token's k outputs weighted and summed in
// choice order (combine). Threads split (expert, channel blocks, row chunks) as `grouped` does, and
// rows elsewhere: no result depends on the thread count or on the other tokens of the batch.
torch::Tensor w8a8_experts(torch::Tensor x, torch::Tensor weights, torch::Tensor experts, torch::Tensor gate_up,
                           torch::Tensor gate_up_scale, torch::Tensor down, torch::Tensor down_scale, int64_t I,
                           double limit) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.device().is_cpu(),
                "w8a8_experts: float32 CPU x [T, D]");
    TORCH_CHECK(experts.dim() == 2 && experts.scalar_type() == torch::kLong && experts.size(0) == x.size(0),
                "w8a8_experts: int64 experts [T, k]");
    TORCH_CHECK(weights.scalar_type() == torch::kFloat && weights.sizes() == experts.sizes(),
                "w8a8_experts: float32 weights [T, k], the shape of experts");
    for (const auto& p : {gate_up, down})
        TORCH_CHECK(p.dim() == 5 && p.scalar_type() == torch::kChar && p.size(3) == LANES && p.size(4) == KG,
                    "w8a8_experts: the weights must come from pack_weight");
    const int64_t T = x.size(0), D = x.size(1), k = experts.size(1), E = gate_up.size(0), I2 = 2 * I;
    const int64_t NB1 = gate_up.size(1), KGN1 = k_groups(gate_up), NB2 = down.size(1), KGN2 = k_groups(down);
    TORCH_CHECK(I > 0 && down.size(0) == E && NB1 == (I2 + LANES - 1) / LANES && KGN1 == (D + KG - 1) / KG &&
                NB2 == (D + LANES - 1) / LANES && KGN2 == (I + KG - 1) / KG,
                "w8a8_experts: x has ", D, " columns and I is ", I,
                ", but the packed weights were made for other shapes");
    TORCH_CHECK(gate_up_scale.scalar_type() == torch::kFloat && gate_up_scale.numel() == E * I2 &&
                down_scale.scalar_type() == torch::kFloat && down_scale.numel() == E * D,
                "w8a8_experts: float32 scales [E, 2I] and [E, D]");
    x = x.contiguous();
    weights = weights.contiguous();
    experts = experts.contiguous();
    gate_up = gate_up.contiguous();
    down = down.contiguous();
    gate_up_scale = gate_up_scale.contiguous();
    down_scale = down_scale.contiguous();
    const int64_t R = T * k;
    if (R == 0) return torch::zeros({T, D}, x.options());
    // the pairs n = t * k + j by expert, stable (by_expert's argsort(stable=True), `by_expert.h`):
    // rows off[e] .. off[e+1] are expert e's; pos[n]: pair n's row; tok[r]: row r's token
    const ouro::ExpertOrder order = ouro::order_by_expert(experts.data_ptr<int64_t>(), R, k, E, "w8a8_experts");
    const std::vector<int64_t>&off = order.start, &pos = order.pos, &tok = order.token;
    // each token quantised once, its values and scale copied to each of its rows (a row's
    // quantisation depends on the row alone)
    const int64_t xs1 = KGN1 * KG, xs2 = KGN2 * KG;
    auto qt = torch::zeros({T, xs1}, x.options().dtype(x_dtype()));
    auto st = torch::empty({T}, x.options());
    quantize_rows(x.data_ptr<float>(), D, T, D, static_cast<XT*>(qt.data_ptr()), xs1, st.data_ptr<float>(), XOFF);
    auto q1 = torch::empty({R, xs1}, qt.options());
    auto s1 = torch::empty({R}, x.options());
    const XT* QT = static_cast<const XT*>(qt.data_ptr());
    XT* Q1 = static_cast<XT*>(q1.data_ptr());
    const float* ST = st.data_ptr<float>();
    float* S1 = s1.data_ptr<float>();
    for (int64_t r = 0; r < R; ++r) {
        std::memcpy(Q1 + r * xs1, QT + tok[r] * xs1, xs1 * sizeof(XT));
        S1[r] = ST[tok[r]];
    }
    auto g = torch::empty({R, I2}, x.options());
    float* G = g.data_ptr<float>();
    grouped(Q1, xs1, gate_up.data_ptr<int8_t>(), E, NB1, KGN1, I2, off.data(),
            Dequantise{S1, gate_up_scale.data_ptr<float>(), G, I2});
    // the clamped SwiGLU of each row's gate and up halves, h quantised per row
    auto q2 = torch::zeros({R, xs2}, qt.options());
    auto s2 = torch::empty({R}, x.options());
    XT* Q2 = static_cast<XT*>(q2.data_ptr());
    float* S2 = s2.data_ptr<float>();
    const float lim = static_cast<float>(limit);
    at::parallel_for(0, R, std::max<int64_t>(1, 4096 / I), [&](int64_t r0, int64_t r1) {
        std::vector<float> h(I);
        for (int64_t r = r0; r < r1; ++r) {
            swiglu_row(G + r * I2, G + r * I2 + I, I, lim, h.data());
            quantize_row(h.data(), I, Q2 + r * xs2, S2 + r, XOFF);
        }
    });
    auto y = torch::empty({R, D}, x.options());
    const float* Y = y.data_ptr<float>();
    grouped(Q2, xs2, down.data_ptr<int8_t>(), E, NB2, KGN2, D, off.data(),
            Dequantise{S2, down_scale.data_ptr<float>(), y.data_ptr<float>(), D});
    // back in token order: each token's k outputs weighted, in choice order
    auto out = torch::empty({T, D}, x.options());
    float* O = out.data_ptr<float>();
    const float* W = weights.data_ptr<float>();
    at::parallel_for(0, T, std::max<int64_t>(1, 16384 / (D * k)), [&](int64_t t0, int64_t t1) {
        std::vector<const float*> rows(k);
        for (int64_t t = t0; t < t1; ++t) {
            for (int64_t j = 0; j < k; ++j) rows[j] = Y + pos[t * k + j] * D;
            weighted_sum(O + t * D, W + t * k, rows.data(), k, D);
        }
    });
    return out;
}

// int8 x [M, K] @ int8 w [N, K].T -> exact int32 [M, N] through the same kernel (packs w on every
// call: for checking the kernel, and for callers without a packed copy)
torch::Tensor int8_mm(torch::Tensor x, torch::Tensor w) {
    TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.scalar_type() == torch::kChar && w.scalar_type() == torch::kChar,
                "int8_mm: int8 x [M, K] and w [N, K]");
    TORCH_CHECK(x.size(1) == w.size(1), "int8_mm: x has ", x.size(1), " columns, w has ", w.size(1));
    const int64_t M = x.size(0), K = x.size(1), N = w.size(0), KGN = (K + KG - 1) / KG, NB = (N + LANES - 1) / LANES;
    auto p = pack_weight(w.unsqueeze(0));
    auto q = torch::zeros({M, KGN * KG}, x.options().dtype(x_dtype()));
    q.narrow(1, 0, K).copy_(x.to(torch::kShort) + XOFF);
    auto out = torch::empty({M, N}, x.options().dtype(torch::kInt));
    auto offsets = torch::tensor({int64_t(0), M}, torch::kLong);
    int32_t* Y = out.data_ptr<int32_t>();
    grouped(static_cast<const XT*>(q.data_ptr()), KGN * KG, p.data_ptr<int8_t>(), 1, NB, KGN, N,
            offsets.data_ptr<int64_t>(), [&](int64_t, int64_t m, int64_t n0, const int32_t* a, int64_t count) {
                std::memcpy(Y + m * N + n0, a, count * sizeof(int32_t));
            });
    return out;
}

// Rows quantised as `ouro.ops.quant.quantize_rows` does, in one pass a row over torch's threads:
// float32 x [M, K] -> (int8 q [M, K], float32 scale [M]). torch's form is ~8 element-wise ops over
// the rows (a 2,048 x 512 prefill input took ~3.4 ms on the Xeon: the W8A8 prefill's largest cost
// around `_int_mm`)
std::tuple<torch::Tensor, torch::Tensor> quantize_int8(torch::Tensor x) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.device().is_cpu(),
                "quantize_int8: float32 CPU x [M, K]");
    x = x.contiguous();
    const int64_t M = x.size(0), K = x.size(1);
    auto q = torch::empty({M, K}, x.options().dtype(torch::kChar));
    auto s = torch::empty({M}, x.options());
    if (M > 0) quantize_rows(x.data_ptr<float>(), K, M, K, q.data_ptr<int8_t>(), K, s.data_ptr<float>());
    return {q, s};
}

std::string features() {
#if defined(OURO_VNNI512)
    return "avx512+vnni";
#elif defined(OURO_VNNI)
    return "avx2+vnni";
#elif defined(OURO_WIDE)
    return "avx2";
#else
    return "scalar";
#endif
}

// The two products a decode step runs and the rows' quantisation, also as torch ops
// (`torch.ops.ouro_int8.*`, fakes in int8_native.py): a compiled graph calls them directly.
TORCH_LIBRARY_FRAGMENT(ouro_int8, m) {
    m.def("w8a8_packed(Tensor x, Tensor p, Tensor w_scale, Tensor offsets, int N) -> Tensor");
    m.def("w8a8_experts(Tensor x, Tensor weights, Tensor experts, Tensor gate_up, Tensor gate_up_scale, "
          "Tensor down, Tensor down_scale, int I, float limit) -> Tensor");
    m.def("quantize_int8(Tensor x) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(ouro_int8, CPU, m) {
    m.impl("w8a8_packed", &w8a8_packed);
    m.impl("w8a8_experts", &w8a8_experts);
    m.impl("quantize_int8", &quantize_int8);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("pack_weight", &pack_weight, "int8 w [E, N, K] -> the packed layout w8a8_packed runs");
    m.def("w8a8_packed", &w8a8_packed, "float32 x [R, K], packed w, float32 w_scale [E, N], int64 offsets [E+1], N");
    m.def("w8a8_experts", &w8a8_experts, "W8A8Experts' routed experts in one call: float32 x [T, D], weights [T, k], "
          "int64 experts [T, k], packed gate_up, its scales [E, 2I], packed down, its scales [E, D], I, limit");
    m.def("int8_mm", &int8_mm, "int8 [M, K] x int8 [N, K] -> int32 [M, N] (x @ w.T), exact");
    m.def("features", &features, "the instruction set this build uses");
}
