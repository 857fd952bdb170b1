// Fused mHC (hyper-connection) ops. The eager weights are ~60 torch ops per hyper-connection (39
// Sinkhorn passes among them) on [T, n, n] tensors: dispatch, not arithmetic, is their cost.
//   hc_pre:      a token's sum of squares, the (2+n)n-wide projection of its streams, scales and
//                biases, sigmoid gates, softmax + eps, every Sinkhorn pass on its n x n in L1
//                (a group's matrices side by side), and the pre-weighted stream sum: one call.
//   hc_post:     the block's output written back: new stream i = post_i * out + sum_j comb[j,i] s_j.
//   hc_post_pre: hc_post, then the next hyper-connection's hc_pre on the new streams while they are
//                in cache (attention's mix with the FFN's weights; a layer's last mix with the next
//                layer's first weights).
// A token's result depends only on that token (every group of tokens, a short one padded with
// repeats, runs the same arithmetic per token), so deterministic mode uses these ops too. The
// projection stays in the kernel at every T: measured against at::mm for the [T, 2048] x [2048, 24]
// product of the `small` preset (T = 16 to 2048, 1 and 2 threads, AVX2), it was as fast or faster.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <type_traits>
#include <vector>

#include "boundary.h"
#include "vec.h"

namespace {

constexpr int64_t MAX_N = 16;            // streams; the n x n matrix lives on the stack
constexpr int64_t GROUP = 8;             // tokens projected together: each pass over fn (from L2) serves 8
constexpr int64_t BLOCK = 4;             // fn rows and tokens of one register tile (ouro::dot_4x4)
constexpr int64_t CHUNK = 512;           // columns of a projection per pass (4 tokens' chunks: 8 KB)
constexpr int64_t GRAIN_FMAS = 1 << 19;  // ~20 us of work per thread before a second one is woken
constexpr int64_t SPLIT_FLOATS = 1 << 14; // one group's projection splits over threads from 64 KB of weights

// one hyper-connection's weights and constants; holds the contiguous tensors its pointers read
struct Hc {
    at::Tensor fn_t, base_t;
    const float *fn, *base;
    float scale[3];
    int64_t n, D, K;
    float norm_eps, hc_eps;
    int64_t iters;
};

void check_f32(const at::Tensor& t, const char* what) {
    TORCH_CHECK(t.scalar_type() == at::kFloat, what, " must be float32, got ", t.scalar_type());
}

Hc make_hc(const at::Tensor& fn, const at::Tensor& base, const at::Tensor& scale, int64_t n, int64_t D,
           double norm_eps, double hc_eps, int64_t iters) {
    check_f32(fn, "fn");
    check_f32(base, "base");
    check_f32(scale, "scale");
    TORCH_CHECK(n >= 1 && n <= MAX_N, "hc_mult ", n, " is outside 1..", MAX_N);
    const int64_t K = (2 + n) * n;
    TORCH_CHECK(fn.dim() == 2 && fn.size(0) == K && fn.size(1) == n * D, "fn must be [", K, ", ", n * D, "], got ", fn.sizes());
    TORCH_CHECK(base.numel() == K && scale.numel() == 3, "base must have ", K, " entries and scale 3");
    Hc h;
    h.fn_t = fn.contiguous();
    h.base_t = base.contiguous();
    h.fn = h.fn_t.data_ptr<float>();
    h.base = h.base_t.data_ptr<float>();
    at::Tensor sc = scale.contiguous();
    for (int k = 0; k < 3; ++k) h.scale[k] = sc.data_ptr<float>()[k];
    h.n = n, h.D = D, h.K = K, h.iters = iters;
    h.norm_eps = static_cast<float>(norm_eps), h.hc_eps = static_cast<float>(hc_eps);
    return h;
}

// Sinkhorn on GROUP matrices side by side (entry (i, j) of matrix k at m[(i * n + j) * GROUP + k]):
// each step runs on all of them at once, so their chains of divisions overlap. Columns first:
// `iters` column passes and iters - 1 row passes, each dividing by (sum + eps), as trained.
void sinkhorn(float* m, int64_t n, int64_t iters, float eps) {
    // one pass: for each line a, the entries (a * along + b * across) for b < n
    auto pass = [&](int64_t along, int64_t across) {
        for (int64_t a = 0; a < n; ++a) {
            float s[GROUP] = {};
            for (int64_t b = 0; b < n; ++b)
                for (int64_t k = 0; k < GROUP; ++k) s[k] += m[(a * along + b * across) * GROUP + k];
            for (int64_t k = 0; k < GROUP; ++k) s[k] += eps;
            for (int64_t b = 0; b < n; ++b)
                for (int64_t k = 0; k < GROUP; ++k) m[(a * along + b * across) * GROUP + k] /= s[k];
        }
    };
    pass(1, n);                       // columns
    for (int64_t it = 1; it < iters; ++it) {
        pass(n, 1);                   // rows
        pass(1, n);
    }
}

// `count` <= GROUP tokens from their projections z [count, K] (of the raw streams: the RMS is a
// per-row scalar, applied here) and their streams rows[k] [n, D]: post and comb of token t0 + k, and
// its block input x = sum_i pre_i s_i (into x0 + k * D). A short group's empty lanes repeat its last token.
void finish(const Hc& h, const float* z, const float* const* rows, int64_t count, int64_t t0, float* x0, float* pp,
            float* cp) {
    const int64_t n = h.n, D = h.D;
    float pre[GROUP][MAX_N], m[MAX_N * MAX_N * GROUP];
    for (int64_t k = 0; k < count; ++k) {
        const float* zt = z + k * h.K;
        const float inv = 1.f / std::sqrt(ouro::sumsq(rows[k], n * D) / static_cast<float>(n * D) + h.norm_eps);
        const float g0 = inv * h.scale[0], g1 = inv * h.scale[1], g2 = inv * h.scale[2];
        for (int64_t i = 0; i < n; ++i) {
            pre[k][i] = ouro::sigmoid(h.base[i] + zt[i] * g0) + h.hc_eps;
            pp[(t0 + k) * n + i] = 2.f * ouro::sigmoid(h.base[n + i] + zt[n + i] * g1);
        }
        for (int64_t i = 0; i < n; ++i) {   // softmax of each row of the comb logits, + eps
            float row[MAX_N], top = -INFINITY, s = 0.f;
            for (int64_t j = 0; j < n; ++j) {
                row[j] = h.base[2 * n + i * n + j] + zt[2 * n + i * n + j] * g2;
                top = std::max(top, row[j]);
            }
            for (int64_t j = 0; j < n; ++j) s += (row[j] = std::exp(row[j] - top));
            for (int64_t j = 0; j < n; ++j) m[(i * n + j) * GROUP + k] = row[j] / s + h.hc_eps;
        }
    }
    for (int64_t k = count; k < GROUP; ++k)         // a short group's empty lanes: its last token again
        for (int64_t e = 0; e < n * n; ++e) m[e * GROUP + k] = m[e * GROUP + count - 1];
    sinkhorn(m, n, h.iters, h.hc_eps);
    for (int64_t k = 0; k < count; ++k) {
        float* comb = cp + (t0 + k) * n * n;
        for (int64_t e = 0; e < n * n; ++e) comb[e] = m[e * GROUP + k];
        const float* streams[MAX_N];
        for (int64_t i = 0; i < n; ++i) streams[i] = rows[k] + i * D;
        ouro::lincomb(x0 + k * D, pre[k], streams, n, D);
    }
}

// the projections z [count, K] of `count` <= GROUP tokens' streams (rows of n*D floats): four rows of
// fn against four tokens at a time (dot_4x4; a short set of rows or tokens padded with repeats), only
// the token blocks the group has, over CHUNK columns at a time so the tokens' chunks stay in L1 while
// every row of fn passes (the partial sums add in chunk order). Rows r0 .. r1 of z only (r0 a multiple
// of BLOCK): each row's sums are the same whichever rows and tokens run beside it.
void project(const Hc& h, const float* const* rows, int64_t count, float* z, int64_t r0, int64_t r1) {
    const int64_t nD = h.n * h.D;
    for (int64_t k = 0; k < count; ++k) std::fill(z + k * h.K + r0, z + k * h.K + r1, 0.f);
    float out[BLOCK * BLOCK];
    for (int64_t c = 0; c < nD; c += CHUNK) {
        const int64_t len = std::min(CHUNK, nD - c);
        for (int64_t r = r0; r < r1; r += BLOCK) {
            const float* a[BLOCK];
            for (int64_t j = 0; j < BLOCK; ++j) a[j] = h.fn + std::min(r + j, h.K - 1) * nD + c;
            for (int64_t k0 = 0; k0 < count; k0 += BLOCK) {
                const float* b[BLOCK];
                for (int64_t q = 0; q < BLOCK; ++q) b[q] = rows[std::min(k0 + q, count - 1)] + c;
                ouro::dot_4x4(a, b, len, out);
                for (int64_t j = 0; j < BLOCK && r + j < r1; ++j)
                    for (int64_t q = 0; q < BLOCK && k0 + q < count; ++q) z[(k0 + q) * h.K + r + j] += out[j * BLOCK + q];
            }
        }
    }
}

// hc_post's operands: the block's output [T, D], the streams it read [T, n, D] (both of the model's
// dtype T: float32, or bfloat16 widened as read), post [T, n], comb [T, n, n] (float32)
template <typename T>
struct Mix {
    const T *out, *streams;
    const float *post, *comb;
    int64_t n, D;

    // new streams of token t into dst [n, D], float32: four streams at a time, each source row
    // loaded once for the four (`lincomb_4`; a last short set repeats its last stream)
    void token(int64_t t, float* dst) const {
        float c[MAX_N][MAX_N + 1];
        const T* src[MAX_N + 1];
        src[0] = out + t * D;
        for (int64_t j = 0; j < n; ++j) src[1 + j] = streams + (t * n + j) * D;
        for (int64_t i = 0; i < n; ++i) {
            c[i][0] = post[t * n + i];
            for (int64_t j = 0; j < n; ++j) c[i][1 + j] = comb[(t * n + j) * n + i];   // comb transposed
        }
        for (int64_t i0 = 0; i0 < n; i0 += 4) {
            float* y[4];
            const float* cs[4];
            for (int64_t q = 0; q < 4; ++q) {
                const int64_t i = std::min(i0 + q, n - 1);
                y[q] = dst + i * D, cs[q] = c[i];
            }
            ouro::lincomb_4(y, cs, src, n + 1, D);
        }
    }
};

template <typename T>
struct MixTensors {   // keeps hc_post's contiguous operands alive while a Mix points into them
    at::Tensor out, streams, post, comb;
    Mix<T> mix;
};

// float32 or bfloat16 tensors of the model (`boundary.h`: widened as read, results rounded once)
template <typename T>
const T* data(const at::Tensor& t) { return static_cast<const T*>(t.data_ptr()); }
template <typename T>
T* data(at::Tensor& t) { return static_cast<T*>(t.data_ptr()); }

void check_model_dtype(const at::Tensor& t, const char* what) {
    TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, what,
                " must be float32 or bfloat16, got ", t.scalar_type());
}

template <typename T>
MixTensors<T> make_mix(const at::Tensor& block_out, const at::Tensor& streams, const at::Tensor& post, const at::Tensor& comb) {
    TORCH_CHECK(block_out.scalar_type() == streams.scalar_type(), "block_out must have the streams' dtype");
    TORCH_CHECK(streams.dim() == 3, "streams must be [T, n, D], got ", streams.sizes());
    const int64_t T_ = streams.size(0), n = streams.size(1), D = streams.size(2);
    TORCH_CHECK(n <= MAX_N, "hc_mult ", n, " is over ", MAX_N);
    TORCH_CHECK(block_out.numel() == T_ * D && post.numel() == T_ * n && comb.numel() == T_ * n * n,
                "block_out / post / comb do not match streams ", streams.sizes());
    MixTensors<T> m{block_out.contiguous(), streams.contiguous(), ouro::f32(post).contiguous(),
                    ouro::f32(comb).contiguous(), {}};
    m.mix = Mix<T>{data<T>(m.out), data<T>(m.streams), m.post.template data_ptr<float>(),
                   m.comb.template data_ptr<float>(), n, D};
    return m;
}

// the weights of `h` for the streams s [T, n, D] of the model's dtype T; with `mix`, each token's
// streams are first written into s by it. Returns (x [T, D] in T, post [T, n], comb [T, n, n] float32).
// float32 streams are read and written in place; bfloat16 ones go through a group's float32 scratch
// (the weights and block input computed from the unrounded new streams, each result rounded once).
template <typename T>
std::tuple<at::Tensor, at::Tensor, at::Tensor> weigh(const Hc& h, at::Tensor& s, const Mix<T>* mix) {
    constexpr bool wide = std::is_same<T, float>::value;
    const int64_t T_ = s.size(0), n = h.n, D = h.D, K = h.K;
    const auto f32 = s.options().dtype(at::kFloat);
    at::Tensor x = at::empty({T_, D}, s.options()), post = at::empty({T_, n}, f32), comb = at::empty({T_, n, n}, f32);
    T *sp = data<T>(s), *xp = data<T>(x);
    float *pp = post.data_ptr<float>(), *cp = comb.data_ptr<float>();
    const int64_t per_token = K * n * D + (mix ? n * (n + 1) * D : 0) + 8 * h.iters * n * n;
    const int64_t groups = (T_ + GROUP - 1) / GROUP;
    // one group of tokens: their new streams (after a mix), projection, weights and block input
    auto group = [&](int64_t g, bool split, std::vector<float>& scratch) {
        float z[GROUP * (2 + MAX_N) * MAX_N];
        const float* rows[GROUP];
        const int64_t t0 = g * GROUP, count = std::min(GROUP, T_ - t0);
        float* x0 = nullptr;
        for (int64_t k = 0; k < count; ++k) {
            T* row = sp + (t0 + k) * n * D;
            if constexpr (wide) {
                if (mix) mix->token(t0 + k, row);
                rows[k] = row;
                x0 = xp + t0 * D;
            } else {
                float* buf = scratch.data() + k * n * D;
                if (mix) {
                    mix->token(t0 + k, buf);
                    ouro::narrow(row, buf, n * D);
                } else {
                    ouro::widen(buf, row, n * D);
                }
                rows[k] = buf;
                x0 = scratch.data() + GROUP * n * D;
            }
        }
        if (split)
            at::parallel_for(0, (K + BLOCK - 1) / BLOCK, 1, [&](int64_t p0, int64_t p1) {
                project(h, rows, count, z, BLOCK * p0, std::min(K, BLOCK * p1));
            });
        else
            project(h, rows, count, z, 0, K);
        finish(h, z, rows, count, t0, x0, pp, cp);
        if constexpr (!wide) ouro::narrow(xp + t0 * D, x0, count * D);
    };
    const int64_t scratch_floats = wide ? 0 : GROUP * (n + 1) * D;
    if (groups == 1 && K * n * D >= SPLIT_FLOATS && at::get_num_threads() > 1) {
        // one group (a decode step of up to GROUP tokens): its projection's rows split over the threads.
        // Its weights come from memory, not cache, where one thread streams ~8 GB/s and two ~13-20
        // (`small`: 196 KB a hyper-connection, 25 us a call on one thread, AVX2 Zen 3)
        std::vector<float> scratch(scratch_floats);
        group(0, true, scratch);
    } else {
        at::parallel_for(0, groups, std::max<int64_t>(1, GRAIN_FMAS / (GROUP * per_token)), [&](int64_t g0, int64_t g1) {
            std::vector<float> scratch(scratch_floats);
            for (int64_t g = g0; g < g1; ++g) group(g, false, scratch);
        });
    }
    return {x, post, comb};
}

template <typename T>
std::tuple<at::Tensor, at::Tensor, at::Tensor> pre(const at::Tensor& streams, const at::Tensor& fn, const at::Tensor& base,
                                                   const at::Tensor& scale, double norm_eps, double hc_eps, int64_t iters) {
    const Hc h = make_hc(fn, base, scale, streams.size(1), streams.size(2), norm_eps, hc_eps, iters);
    at::Tensor s = streams.contiguous();
    return weigh<T>(h, s, nullptr);
}

template <typename T>
at::Tensor post_mix(const at::Tensor& block_out, const at::Tensor& streams, const at::Tensor& post, const at::Tensor& comb) {
    const MixTensors<T> m = make_mix<T>(block_out, streams, post, comb);
    const int64_t T_ = streams.size(0), n = m.mix.n, D = m.mix.D;
    at::Tensor y = at::empty({T_, n, D}, streams.options());
    T* yp = data<T>(y);
    at::parallel_for(0, T_, std::max<int64_t>(1, GRAIN_FMAS / (n * (n + 1) * D)), [&](int64_t t0, int64_t t1) {
        std::vector<float> buf(std::is_same<T, float>::value ? 0 : n * D);
        for (int64_t t = t0; t < t1; ++t) {
            if constexpr (std::is_same<T, float>::value) {
                m.mix.token(t, yp + t * n * D);
            } else {
                m.mix.token(t, buf.data());
                ouro::narrow(yp + t * n * D, buf.data(), n * D);
            }
        }
    });
    return y;
}

template <typename T>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> post_pre(
        const at::Tensor& block_out, const at::Tensor& streams, const at::Tensor& post, const at::Tensor& comb,
        const at::Tensor& fn, const at::Tensor& base, const at::Tensor& scale, double norm_eps, double hc_eps,
        int64_t iters) {
    const MixTensors<T> m = make_mix<T>(block_out, streams, post, comb);
    const Hc h = make_hc(fn, base, scale, m.mix.n, m.mix.D, norm_eps, hc_eps, iters);
    at::Tensor y = at::empty(streams.sizes(), streams.options());
    auto [x, p, c] = weigh<T>(h, y, &m.mix);
    return {y, x, p, c};
}

// the ops: the streams and block output in the model's dtype (float32, or bfloat16 read and written as
// such: `widen` / `narrow`), the projection and the mixing weights in float32 (a bfloat16 `fn` converted
// at the boundary), the new streams and block input returned in the streams' dtype and the mixing
// weights in float32, as the eager path gives them (`ouro/ops/mhc/sinkhorn.py`)
std::tuple<at::Tensor, at::Tensor, at::Tensor> hc_pre(const at::Tensor& streams, const at::Tensor& fn, const at::Tensor& base,
                                                      const at::Tensor& scale, double norm_eps, double hc_eps, int64_t iters) {
    check_model_dtype(streams, "streams");
    TORCH_CHECK(streams.dim() == 3, "streams must be [T, n, D], got ", streams.sizes());
    const at::Tensor f = ouro::f32(fn), b = ouro::f32(base), sc = ouro::f32(scale);
    return streams.scalar_type() == at::kFloat ? pre<float>(streams, f, b, sc, norm_eps, hc_eps, iters)
                                               : pre<ouro::bf16_t>(streams, f, b, sc, norm_eps, hc_eps, iters);
}

at::Tensor hc_post(const at::Tensor& block_out, const at::Tensor& streams, const at::Tensor& post, const at::Tensor& comb) {
    check_model_dtype(streams, "streams");
    return streams.scalar_type() == at::kFloat ? post_mix<float>(block_out, streams, post, comb)
                                               : post_mix<ouro::bf16_t>(block_out, streams, post, comb);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> hc_post_pre(
        const at::Tensor& block_out, const at::Tensor& streams, const at::Tensor& post, const at::Tensor& comb,
        const at::Tensor& fn, const at::Tensor& base, const at::Tensor& scale, double norm_eps, double hc_eps,
        int64_t iters) {
    check_model_dtype(streams, "streams");
    const at::Tensor f = ouro::f32(fn), b = ouro::f32(base), sc = ouro::f32(scale);
    return streams.scalar_type() == at::kFloat
        ? post_pre<float>(block_out, streams, post, comb, f, b, sc, norm_eps, hc_eps, iters)
        : post_pre<ouro::bf16_t>(block_out, streams, post, comb, f, b, sc, norm_eps, hc_eps, iters);
}

std::string mhc_isa(int64_t force_portable) { return ouro::isa_switch(force_portable); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(ouro_native, m) {
    m.def("hc_pre(Tensor streams, Tensor fn, Tensor base, Tensor scale, float norm_eps, float hc_eps, int iters) "
          "-> (Tensor, Tensor, Tensor)");
    m.def("hc_post(Tensor block_out, Tensor streams, Tensor post, Tensor comb) -> Tensor");
    m.def("hc_post_pre(Tensor block_out, Tensor streams, Tensor post, Tensor comb, Tensor fn, Tensor base, "
          "Tensor scale, float norm_eps, float hc_eps, int iters) -> (Tensor, Tensor, Tensor, Tensor)");
    m.def("mhc_isa(int force_portable) -> str", &mhc_isa);
}

TORCH_LIBRARY_IMPL(ouro_native, CPU, m) {
    m.impl("hc_pre", &hc_pre);
    m.impl("hc_post", &hc_post);
    m.impl("hc_post_pre", &hc_post_pre);
}
