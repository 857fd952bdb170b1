// Sampling's reductions over the vocabulary in one op: each row's pick (its first maximum where the
// row samples greedily, the first NaN where it has one, else the id the sampler drew) and that pick's
// log-probability under the row's log-softmax, read in two passes over the row (max, then the sum of
// e^(x - max)) with nothing of the vocabulary's width written. torch's path (max, then a whole
// log-softmax and a gather) wrote a [B, V] temporary and made three calls; at batch 1 on `small`'s
// 32,000-wide head it cost ~0.1 ms of a ~4 ms step. One row per task: a row's result never depends on
// the rows beside it (deterministic inference stays batch-invariant).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <limits>
#include <tuple>

#include "vec.h"

namespace {

constexpr int64_t GRAIN_ELEMENTS = 1 << 15;   // a thread takes rows worth ~128 KB of logits at least

// the row's largest value, or NaN when it holds one
float row_max(const float* x, int64_t V) {
    int64_t i = 0;
    float m = -std::numeric_limits<float>::infinity();
    bool nan = false;
    if (!ouro::portable()) {
#if defined(__AVX512F__)
        __m512 mx = _mm512_set1_ps(m);
        __mmask16 bad = 0;
        for (; i + 16 <= V; i += 16) {
            const __m512 v = _mm512_loadu_ps(x + i);
            bad |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            mx = _mm512_max_ps(mx, v);
        }
        nan = bad != 0;
        m = _mm512_reduce_max_ps(mx);
#elif defined(__AVX2__) && defined(__FMA__)
        __m256 mx = _mm256_set1_ps(m), mx2 = mx, bad = _mm256_setzero_ps();
        for (; i + 16 <= V; i += 16) {      // two chains of maxima: one max's latency per 16 values
            const __m256 v = _mm256_loadu_ps(x + i), w = _mm256_loadu_ps(x + i + 8);
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, w, _CMP_UNORD_Q));
            mx = _mm256_max_ps(mx, v);
            mx2 = _mm256_max_ps(mx2, w);
        }
        mx = _mm256_max_ps(mx, mx2);
        for (; i + 8 <= V; i += 8) {
            const __m256 v = _mm256_loadu_ps(x + i);
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            mx = _mm256_max_ps(mx, v);
        }
        nan = _mm256_movemask_ps(bad) != 0;
        float lanes[8];
        _mm256_storeu_ps(lanes, mx);
        for (float l : lanes) m = std::max(m, l);
#endif
    }
    for (; i < V; ++i) {
        nan |= std::isnan(x[i]);
        m = std::max(m, x[i]);
    }
    return nan ? std::numeric_limits<float>::quiet_NaN() : m;
}

// sum of e^(x - m) over the row (m its finite maximum: every term's exponent <= 0), in lanes
float row_exp_sum(const float* x, int64_t V, float m) {
    int64_t i = 0;
    float s = 0.f;
    if (!ouro::portable()) {
#if defined(__AVX512F__)
        const __m512 mv = _mm512_set1_ps(m);
        __m512 acc = _mm512_setzero_ps();
        for (; i + 16 <= V; i += 16) acc = _mm512_add_ps(acc, ouro::exp_nonpos512(_mm512_sub_ps(_mm512_loadu_ps(x + i), mv)));
        if (i < V) {
            const __mmask16 k = __mmask16((1u << (V - i)) - 1);
            acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(k, ouro::exp_nonpos512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), mv))));
            i = V;
        }
        s = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
        const __m256 mv = _mm256_set1_ps(m);
        __m256 acc = _mm256_setzero_ps(), acc2 = acc;
        for (; i + 16 <= V; i += 16) {      // two independent polynomials in flight
            acc = _mm256_add_ps(acc, ouro::exp_nonpos256(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv)));
            acc2 = _mm256_add_ps(acc2, ouro::exp_nonpos256(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8), mv)));
        }
        acc = _mm256_add_ps(acc, acc2);
        for (; i + 8 <= V; i += 8) acc = _mm256_add_ps(acc, ouro::exp_nonpos256(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv)));
        if (i < V) {     // the tail through the same polynomial, padded with -inf (e^-inf = 0)
            float pad[8];
            for (int64_t j = 0; j < 8; ++j) pad[j] = i + j < V ? x[i + j] : -std::numeric_limits<float>::infinity();
            acc = _mm256_add_ps(acc, ouro::exp_nonpos256(_mm256_sub_ps(_mm256_loadu_ps(pad), mv)));
            i = V;
        }
        s = ouro::hsum256(acc);
#endif
    }
    double rest = 0.0;      // the portable loop's one running sum over a whole row: in double
    for (; i < V; ++i) rest += std::exp(static_cast<double>(x[i]) - m);
    return static_cast<float>(s + rest);
}

// ids[b]: chosen[b] where it is >= 0, else the row's first maximum (its first NaN if it has one, as
// torch's max(dim) picks); logprob[b]: log_softmax(row)[ids[b]], NaN where torch's is (a NaN or +inf
// in the row, or every value -inf)
// the first i with x[i] == m (m one of the row's values): sixteen or eight compares a step, where the
// scalar scan spent ~1 cycle a value (half the row on average: ~40% of a 32,000-wide row's time)
int64_t first_equal(const float* x, int64_t V, float m) {
    int64_t i = 0;
    if (!ouro::portable()) {
#if defined(__AVX512F__)
        const __m512 mv = _mm512_set1_ps(m);
        for (; i + 16 <= V; i += 16) {
            const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), mv, _CMP_EQ_OQ);
            if (eq) return i + __builtin_ctz(eq);
        }
#elif defined(__AVX2__) && defined(__FMA__)
        const __m256 mv = _mm256_set1_ps(m);
        for (; i + 8 <= V; i += 8) {
            const int eq = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), mv, _CMP_EQ_OQ));
            if (eq) return i + __builtin_ctz(eq);
        }
#endif
    }
    while (x[i] != m) ++i;
    return i;
}

std::tuple<at::Tensor, at::Tensor> pick_logprobs(const at::Tensor& logits, const at::Tensor& chosen_in) {
    TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1,
                "logits must be float32 [B, V] with contiguous rows, got ", logits.scalar_type(), " ", logits.sizes());
    const int64_t B = logits.size(0), V = logits.size(1), rs = logits.stride(0);
    TORCH_CHECK(V > 0, "logits need at least one column");
    TORCH_CHECK(chosen_in.scalar_type() == at::kLong && chosen_in.dim() == 1 && chosen_in.size(0) == B,
                "chosen must be int64 [B] (-1: the row's maximum)");
    at::Tensor chosen = chosen_in.contiguous();
    const int64_t* cp = chosen.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) TORCH_CHECK(cp[b] >= -1 && cp[b] < V, "chosen id ", cp[b], " outside [-1, ", V, ")");
    at::Tensor ids = at::empty({B}, chosen.options());
    at::Tensor lp = at::empty({B}, logits.options());
    const float* xp = logits.data_ptr<float>();
    int64_t* ip = ids.data_ptr<int64_t>();
    float* lpp = lp.data_ptr<float>();
    const float nan = std::numeric_limits<float>::quiet_NaN();
    at::parallel_for(0, B, std::max<int64_t>(1, GRAIN_ELEMENTS / V), [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) {
            const float* x = xp + b * rs;
            const float m = row_max(x, V);
            int64_t id = cp[b];
            if (std::isnan(m)) {
                if (id < 0) for (id = 0; !std::isnan(x[id]); ++id) {}
                ip[b] = id;
                lpp[b] = nan;
                continue;
            }
            if (id < 0) id = first_equal(x, V, m);
            ip[b] = id;
            lpp[b] = std::isinf(m) ? nan : (x[id] - m) - std::log(row_exp_sum(x, V, m));
        }
    });
    return {ids, lp};
}

std::string sample_isa(int64_t force_portable) { return ouro::isa_switch(force_portable); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(ouro_native, m) {
    m.def("pick_logprobs(Tensor logits, Tensor chosen) -> (Tensor, Tensor)");
    m.def("sample_isa(int force_portable) -> str", &sample_isa);
}

TORCH_LIBRARY_IMPL(ouro_native, CPU, m) {
    m.impl("pick_logprobs", &pick_logprobs);
}
