// The MoE router as one op: the float32 router product, sigmoid, the correction bias (it steers the
// choice, not the weights), the group-limited top-k (a group scores the sum of its two best
// choices; the best `topk_group` groups stay), the chosen experts' sigmoid weights normalised and
// scaled. torch ran ~15 ops for this per layer.
//
// The product is the op's own (four experts against four tokens a register tile, `products`): torch's
// (~10 us for `small`'s 16 x 512 x 32 on one thread, most of the router's time) rounded differently at
// each batch size, this one gives a token the same bits at any batch size and any split over threads,
// so deterministic mode needs no other path. Its roundings differ from the eager product's (`x @ W.T`,
// `ouro/ops/moe/routing.py`) in the last bits, so the two can order two experts (or groups) whose
// scores lie within float32 rounding of each other differently: either order is the exact answer
// rounded, as between any two float32 products (the fused model's router input already differs from
// the eager model's by such roundings). Everywhere else the choice is the eager code's. Where the
// op's own scores tie exactly (duplicate router rows, a zero row), the selections run torch.topk's
// own CPU loop (ATen/native/TopKImpl.h), whose order among equal values is its std::nth_element's
// and no fixed rule, as the eager code's torch.topk would on those scores; elsewhere the answer is
// unique and a short insertion finds it (`topk_distinct`).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/native/TopKImpl.h>
#include <ATen/ops/empty.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "boundary.h"
#include "vec.h"

namespace {

// a call of at least this many multiply-adds splits its product over the threads (~10 us on one)
constexpr int64_t SPLIT_MACS = 1 << 17;

// torch.topk(v, k, largest=True, sorted=True) on `rows` rows of a [rows, m] matrix
void topk_rows(const float* v, int64_t rows, int64_t m, int64_t k, float* values, int64_t* indices) {
    char* data[3] = {reinterpret_cast<char*>(values), reinterpret_cast<char*>(indices),
                     reinterpret_cast<char*>(const_cast<float*>(v))};
    const int64_t strides[3] = {k * int64_t(sizeof(float)), k * int64_t(sizeof(int64_t)), m * int64_t(sizeof(float))};
    at::native::topk_impl_loop<float, float>(1, 1, 1, k, m, /*largest=*/true, /*sorted=*/true, data, strides, rows);
}

// the sum of a group's two largest values, as topk(2).values.sum() gives it (NaN ranks first)
float top2_sum(const float* v, int64_t n) {
    float a = -std::numeric_limits<float>::infinity(), b = a;
    for (int64_t i = 0; i < n; ++i) {
        if (std::isnan(v[i])) return v[i];
        if (v[i] > a) { b = a; a = v[i]; } else if (v[i] > b) { b = v[i]; }
    }
    return a + b;
}

// torch.topk(v, k, largest=True, sorted=True) of one row of m values where its answer is unique: the
// k largest by insertion into a descending list of k + 1, refused (false) where a NaN is in the row or
// two of the k + 1 largest are equal (then torch's own loop decides, `topk_rows`). With distinct
// values the k largest in descending order are one answer whatever the algorithm: a row of `small`'s
// routing took ~2,000 cycles through torch's loop, ~150 here.
bool topk_distinct(const float* v, int64_t m, int64_t k, float* values, int64_t* indices) {
    constexpr int64_t MAX_K = 16;
    if (k + 1 > MAX_K) return false;
    const int64_t keep = std::min(k + 1, m);
    float top[MAX_K];
    int64_t at[MAX_K];
    int64_t n = 0;
    for (int64_t i = 0; i < m; ++i) {
        const float x = v[i];
        if (std::isnan(x)) return false;
        if (n == keep && !(x > top[n - 1])) continue;
        int64_t j = n < keep ? n++ : n - 1;
        while (j > 0 && top[j - 1] < x) {
            top[j] = top[j - 1], at[j] = at[j - 1];
            --j;
        }
        top[j] = x, at[j] = i;
    }
    // equals among the k kept, or the k-th equal to the next: torch's order among them decides. (A value
    // dropped or passed over is at most the (k+1)-th, so a tie of it with the k-th shows here too.)
    for (int64_t j = 0; j + 1 < n; ++j)
        if (top[j] == top[j + 1]) return false;
    for (int64_t j = 0; j < k; ++j) values[j] = top[j], indices[j] = at[j];
    return true;
}

// topk_rows on one row, through topk_distinct where its answer is unique
void topk_row(const float* v, int64_t m, int64_t k, float* values, int64_t* indices) {
    if (!topk_distinct(v, m, k, values, indices)) topk_rows(v, 1, m, k, values, indices);
}

// rows [t0, t1) of the selection, from their sigmoid scores [t1 - t0, E]
void select(const float* score, const float* bias, int64_t t0, int64_t t1, int64_t E, int64_t top_k, int64_t n_group,
            int64_t topk_group, bool norm_topk, float scale, float* weights, int64_t* experts) {
    const int64_t per = E / n_group;
    std::vector<float> choice(E), group(n_group), kept_v(topk_group), chosen_v(top_k);
    std::vector<int64_t> kept(topk_group);
    std::vector<char> keep(n_group);
    for (int64_t t = t0; t < t1; ++t) {
        const float* s = score + (t - t0) * E;
        float* c = choice.data();
        for (int64_t e = 0; e < E; ++e) c[e] = s[e] + bias[e];
        if (n_group > 1) {
            for (int64_t g = 0; g < n_group; ++g) group[g] = top2_sum(c + g * per, per);
            topk_row(group.data(), n_group, topk_group, kept_v.data(), kept.data());
            std::fill(keep.begin(), keep.end(), 0);
            for (int64_t j = 0; j < topk_group; ++j) keep[kept[j]] = 1;
            for (int64_t g = 0; g < n_group; ++g)
                if (!keep[g]) std::fill(c + g * per, c + (g + 1) * per, -std::numeric_limits<float>::infinity());
        }
        int64_t* ce = experts + t * top_k;
        topk_row(c, E, top_k, chosen_v.data(), ce);
        float* w = weights + t * top_k;
        float sum = 0.f;
        for (int64_t j = 0; j < top_k; ++j) sum += (w[j] = s[ce[j]]);
        const float div = sum + 1e-20f;
        for (int64_t j = 0; j < top_k; ++j) w[j] = (norm_topk ? w[j] / div : w[j]) * scale;
    }
}

// the router's products of tokens [t0, t1) with experts [e0, e1) (e0 a multiple of 4) into s [T, E]
// (row t at s + t * E): x_t . w_e, four experts against four tokens a register tile (dot_4x4), a last
// short set of tokens one at a time against the four (dot_1x4: the same sums, bit for bit), a short
// set of experts padded with the last one. A product is the same bits whatever tokens and experts run
// beside it (deterministic mode's batch invariance).
void products(const float* x, const float* w, int64_t t0, int64_t t1, int64_t e0, int64_t e1, int64_t E, int64_t D,
              float* s) {
    float out[16];
    for (int64_t e = e0; e < e1; e += 4) {
        const float* a[4];
        for (int64_t j = 0; j < 4; ++j) a[j] = w + std::min(e + j, E - 1) * D;
        const int64_t m = std::min<int64_t>(4, e1 - e);
        int64_t t = t0;
        for (; t + 4 <= t1; t += 4) {
            const float* b[4] = {x + t * D, x + (t + 1) * D, x + (t + 2) * D, x + (t + 3) * D};
            ouro::dot_4x4(a, b, D, out);
            for (int64_t j = 0; j < m; ++j)
                for (int64_t q = 0; q < 4; ++q) s[(t + q) * E + e + j] = out[j * 4 + q];
        }
        for (; t < t1; ++t) {
            ouro::dot_1x4(x + t * D, a, D, out);
            for (int64_t j = 0; j < m; ++j) s[t * E + e + j] = out[j];
        }
    }
}

std::tuple<at::Tensor, at::Tensor> route_f32(const at::Tensor& x_in, const at::Tensor& weight_in, const at::Tensor& bias_in,
                                             int64_t top_k, int64_t n_group, int64_t topk_group, bool norm_topk,
                                             double scaling) {
    TORCH_CHECK(x_in.scalar_type() == at::kFloat && weight_in.scalar_type() == at::kFloat &&
                bias_in.scalar_type() == at::kFloat, "route: x, weight and bias must be float32");
    TORCH_CHECK(x_in.dim() == 2 && weight_in.dim() == 2 && weight_in.size(1) == x_in.size(1) &&
                bias_in.numel() == weight_in.size(0), "route: x must be [T, D], weight [E, D] and bias [E]");
    const int64_t T = x_in.size(0), E = weight_in.size(0), D = x_in.size(1);
    TORCH_CHECK(n_group >= 1 && E % n_group == 0 && topk_group >= 1 && topk_group <= n_group,
                "route: ", E, " experts do not split into ", n_group, " groups keeping ", topk_group);
    const int64_t per = E / n_group;
    TORCH_CHECK(top_k >= 1 && top_k <= topk_group * per, "route: top_k ", top_k, " exceeds the experts the groups keep");
    TORCH_CHECK(n_group == 1 || per >= 2, "route: a group needs two experts to score");
    const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous(), bias = bias_in.contiguous();
    at::Tensor weights = at::empty({T, top_k}, x.options());
    at::Tensor experts = at::empty({T, top_k}, x.options().dtype(at::kLong));
    const float *xp = x.data_ptr<float>(), *w = weight.data_ptr<float>(), *bp = bias.data_ptr<float>();
    float* wp = weights.data_ptr<float>();
    int64_t* ep = experts.data_ptr<int64_t>();
    const float scale = static_cast<float>(scaling);
    std::vector<float> s(T * E);
    // rows [t0, t1): their scores' sigmoid, then their selection
    auto choose = [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) ouro::sigmoid_row(s.data() + t * E, s.data() + t * E, E);
        select(s.data() + t0 * E, bp, t0, t1, E, top_k, n_group, topk_group, norm_topk, scale, wp, ep);
    };
    const int threads = at::get_num_threads();
    if (T * E * D >= SPLIT_MACS && threads > 1 && !at::in_parallel_region()) {
        // the product split by experts (each thread reads its share of the router's weights, which come
        // from memory: a token split had every thread read all of them), then the selections by tokens
        const int64_t blocks = (E + 3) / 4;
#pragma omp parallel num_threads(threads)
        {
            const int64_t id = omp_get_thread_num(), team = omp_get_num_threads();
            const int64_t b0 = blocks * id / team, b1 = blocks * (id + 1) / team;
            if (b0 < b1) products(xp, w, 0, T, 4 * b0, std::min(E, 4 * b1), E, D, s.data());
#pragma omp barrier
            const int64_t t0 = T * id / team, t1 = T * (id + 1) / team;
            if (t0 < t1) choose(t0, t1);
        }
    } else {
        products(xp, w, 0, T, 0, E, E, D, s.data());
        choose(0, T);
    }
    return {weights, experts};
}

// float32 inside: a bfloat16 model's rows converted at the boundary (`boundary.h`), as the eager path
// scores `x.float() @ W.float().T`; the routing weights come back in float32, as there
std::tuple<at::Tensor, at::Tensor> route(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                         int64_t top_k, int64_t n_group, int64_t topk_group, bool norm_topk,
                                         double scaling) {
    return route_f32(ouro::f32(x), ouro::f32(weight), ouro::f32(bias), top_k, n_group, topk_group, norm_topk, scaling);
}

std::string router_isa(int64_t force_portable) { return ouro::isa_switch(force_portable); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(ouro_native, m) {
    m.def("route(Tensor x, Tensor weight, Tensor bias, int top_k, int n_group, int topk_group, bool norm_topk, "
          "float scaling) -> (Tensor, Tensor)");
    m.def("router_isa(int force_portable) -> str", &router_isa);
}

TORCH_LIBRARY_IMPL(ouro_native, CPU, m) {
    m.impl("route", &route);
}
