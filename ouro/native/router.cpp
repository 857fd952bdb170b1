// The MoE router as one op: the float32 router product, sigmoid, the correction bias (it steers the
// choice, not the weights), the group-limited top-k (a group scores the sum of its two best
// choices; the best `topk_group` groups stay), the chosen experts' sigmoid weights normalised and
// scaled. torch ran ~15 ops for this per layer. Ties go to the lower index, in groups and experts
// alike; the experts come out best first, as torch.topk returns them.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <tuple>
#include <vector>

#include "vec.h"

namespace {

// the indices of the n largest of v[0..m) (ties: the lower index first), best first
void top_n(const float* v, int64_t m, int64_t n, int64_t* out, std::vector<int64_t>& idx) {
    idx.resize(m);
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + n, idx.end(),
                      [&](int64_t a, int64_t b) { return v[a] > v[b] || (v[a] == v[b] && a < b); });
    std::copy(idx.begin(), idx.begin() + n, out);
}

std::tuple<at::Tensor, at::Tensor> route(const at::Tensor& x_in, const at::Tensor& weight_in, const at::Tensor& bias_in,
                                         int64_t top_k, int64_t n_group, int64_t topk_group, bool norm_topk,
                                         double scaling) {
    TORCH_CHECK(x_in.scalar_type() == at::kFloat && weight_in.scalar_type() == at::kFloat &&
                bias_in.scalar_type() == at::kFloat, "route: x, weight and bias must be float32");
    const at::Tensor x = x_in.contiguous(), W = weight_in.contiguous(), bias = bias_in.contiguous();
    const int64_t T = x.size(0), D = x.size(1), E = W.size(0);
    TORCH_CHECK(W.size(1) == D && bias.numel() == E, "route: weight must be [E, D] and bias [E]");
    TORCH_CHECK(n_group >= 1 && E % n_group == 0 && topk_group >= 1 && topk_group <= n_group,
                "route: ", E, " experts do not split into ", n_group, " groups keeping ", topk_group);
    const int64_t per = E / n_group;
    TORCH_CHECK(top_k >= 1 && top_k <= topk_group * per, "route: top_k ", top_k, " exceeds the experts the groups keep");
    TORCH_CHECK(n_group == 1 || per >= 2, "route: a group needs two experts to score");
    at::Tensor weights = at::empty({T, top_k}, x.options());
    at::Tensor experts = at::empty({T, top_k}, x.options().dtype(at::kLong));
    const float *xp = x.data_ptr<float>(), *wp = W.data_ptr<float>(), *bp = bias.data_ptr<float>();
    float* op = weights.data_ptr<float>();
    int64_t* ep = experts.data_ptr<int64_t>();
    const float scale = static_cast<float>(scaling);
    at::parallel_for(0, T, std::max<int64_t>(1, 8192 / std::max<int64_t>(1, E * D / 64)), [&](int64_t t0, int64_t t1) {
        std::vector<float> score(E), choice(E), group(n_group);
        std::vector<int64_t> idx, keep(topk_group), top2(2);
        for (int64_t t = t0; t < t1; ++t) {
            for (int64_t e = 0; e < E; ++e) {
                score[e] = ouro::sigmoid(ouro::dot(xp + t * D, wp + e * D, D));
                choice[e] = score[e] + bp[e];
            }
            if (n_group > 1) {
                for (int64_t g = 0; g < n_group; ++g) {
                    top_n(choice.data() + g * per, per, 2, top2.data(), idx);
                    group[g] = choice[g * per + top2[0]] + choice[g * per + top2[1]];
                }
                top_n(group.data(), n_group, topk_group, keep.data(), idx);
                std::vector<bool> kept(n_group, false);
                for (int64_t g : keep) kept[g] = true;
                for (int64_t e = 0; e < E; ++e)
                    if (!kept[e / per]) choice[e] = -std::numeric_limits<float>::infinity();
            }
            int64_t* chosen = ep + t * top_k;
            top_n(choice.data(), E, top_k, chosen, idx);
            float* w = op + t * top_k;
            float sum = 0.f;
            for (int64_t j = 0; j < top_k; ++j) sum += (w[j] = score[chosen[j]]);
            const float div = norm_topk ? sum + 1e-20f : 1.f;
            for (int64_t j = 0; j < top_k; ++j) w[j] = (norm_topk ? w[j] / div : w[j]) * scale;
        }
    });
    return {weights, experts};
}

std::string router_isa(int64_t force_portable) {
    if (force_portable >= 0) ouro::portable() = force_portable != 0;
    return ouro::isa();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ouro_native, m) {
    m.def("route(Tensor x, Tensor weight, Tensor bias, int top_k, int n_group, int topk_group, bool norm_topk, "
          "float scaling) -> (Tensor, Tensor)");
    m.def("router_isa(int force_portable) -> str", &router_isa);
}

TORCH_LIBRARY_IMPL(ouro_native, CPU, m) {
    m.impl("route", &route);
}
