// The KDA decode step of one layer as one op (`kda_decode`), and a prefill chunk of each sequence
// as one op (`kda_prefill`: the same per-token work, token after token within a sequence, the
// state in its slot and in L1 all along; torch's chunked form ran ~200 ops and a chunk loop per
// layer). For each (request, head), the causal conv with SiLU (`Conv`: a token's inputs read as rows
// across the head's channels, from the sequence itself or, for its first tokens, from the slot's
// window, which then takes the last inputs; a per-channel rolled window ran ~25% of the prefill op
// in shuffles), the L2 norms of q and k, the forget gate
// `lower_bound * sigmoid(exp(A_log) * (f + dt_bias))` (a scale, not a clamp; `-exp(A_log) *
// softplus(f + dt_bias)` where the config has no bound), beta, the gated delta-rule update of the
// state in place in its slot, and the gated RMSNorm of the output. Each norm and gate is computed
// once per (token, head), a head's exponentials (SiLU, gates) as vector rows; torch ran ~60 ops
// for this per layer.
//
// State order. S [dk, dv] (key rows of dv floats, as the eager code's [N, H, dk, dv]); per key row i:
// S_i *= exp(g_i); pred = sum_i k_i S_i; u = beta (v - pred); S_i += k_i u; o = sum_i q_i S_i. The
// update needs u, u needs pred, and pred needs every decayed row, so no row can be finished before all
// were read: one sweep cannot do it (each value column alone could, but a column is strided by dv).
// Two sweeps over the rows (`rows_scale_tdot`, `rows_rank1_tdot` in tiles.h, the column sums in
// registers): 1) decay row i and add k_i S_i to pred; 2) add k_i u to row i and q_i S_i to o, the
// output read from the updated rows as the eager code does. The head's state (16 KB at 64 x 64) stays
// in L1 between the sweeps, so it moves to and from memory once per step.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "boundary.h"
#include "vec.h"

namespace {

inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }   // torch's threshold

// The causal conv of n channels (one head's q, k or v) over a sequence's tokens, vectorised across
// channels: `hist` holds the W inputs before the sequence as rows [W][n] (from the slot's window,
// [n][W] per channel), `wt` the weights as rows [W + 1][n] of stride `ws` (all channels' weights
// transposed once per call). out[j] = sum_m in(t - W + m)[j] wt[m][j] + x[j] wt[W][j], summed in
// order of m with one fused multiply-add a term (the first a product).
struct Conv {
    const float* hist;
    const float* wt;
    int64_t n, W, ws;

    // token t of the sequence (t0 its first row), its input rows at row(s)
    template <typename Row>
    void step(int64_t t, int64_t t0, Row row, float* __restrict out) const {
        const float* in[8];
        for (int64_t m = 0; m < W; ++m) {
            const int64_t s = t - W + m;
            in[m] = s >= t0 ? row(s) : hist + (W - (t0 - s)) * n;
        }
        const float* x = row(t);
        int64_t j = 0;
#if defined(OURO_LANES)
        if (!ouro::portable()) {
            using L = ouro::Lanes;
            for (; j + L::W <= n; j += L::W) {
                L::T acc = W > 0 ? L::mul(L::load(in[0] + j), L::load(wt + j)) : L::zero();
                for (int64_t m = 1; m < W; ++m) acc = L::fma(L::load(in[m] + j), L::load(wt + m * ws + j), acc);
                L::store(out + j, L::fma(L::load(x + j), L::load(wt + W * ws + j), acc));
            }
        }
#endif
        for (; j < n; ++j) {
            float acc = W > 0 ? in[0][j] * wt[j] : 0.f;
            for (int64_t m = 1; m < W; ++m) acc = std::fma(in[m][j], wt[m * ws + j], acc);
            out[j] = std::fma(x[j], wt[W * ws + j], acc);
        }
    }
};

constexpr int64_t PREFETCH_TOKENS = 2;     // how far ahead a sequence's next rows are fetched

// the rows [W][n] of a channel-major window [n][W] (or weights [n][K])
void window_to_rows(const float* win, int64_t n, int64_t W, float* rows) {
    for (int64_t j = 0; j < n; ++j)
        for (int64_t m = 0; m < W; ++m) rows[m * n + j] = win[j * W + m];
}

void check(const at::Tensor& t, const char* what, at::ScalarType dtype = at::kFloat, bool rows = false) {
    TORCH_CHECK(t.scalar_type() == dtype, "kda_decode: ", what, " has dtype ", t.scalar_type());
    // per-token inputs may be row-strided views (the parts of one merged product's output)
    TORCH_CHECK(rows ? (t.dim() == 2 && t.stride(1) == 1) : t.is_contiguous(), "kda_decode: ", what,
                rows ? " must be [T, n] with contiguous rows" : " must be contiguous");
}

// Sequence n's tokens are rows starts[n] .. starts[n+1] of the inputs (`starts` empty: one token
// each, a decode step); slots and fresh are per sequence.
at::Tensor kda_sequences(const at::Tensor& mixed, const at::Tensor& f, const at::Tensor& b, const at::Tensor& gate,
                         const at::Tensor& conv_w, const at::Tensor& dt_bias, const at::Tensor& A_log,
                         double lower_bound, const at::Tensor& norm_w, double eps, at::Tensor& conv_state,
                         at::Tensor& rec_state, const at::Tensor& slots, const at::Tensor& fresh,
                         const at::Tensor& starts) {
    for (auto [t, name] : {std::pair{&mixed, "mixed"}, {&f, "f"}, {&b, "b"}, {&gate, "gate"}})
        check(*t, name, at::kFloat, true);
    for (auto [t, name] : {std::pair{&conv_w, "conv weight"}, {&dt_bias, "dt_bias"}, {&A_log, "A_log"},
                           {&norm_w, "norm weight"}, {&conv_state, "conv state"}, {&rec_state, "recurrent state"}})
        check(*t, name);
    check(slots, "slots", at::kLong);
    check(fresh, "fresh", at::kBool);
    const int64_t T = mixed.size(0), C3 = mixed.size(1), C = C3 / 3, H = A_log.size(0), dk = C / H;
    const int64_t S = rec_state.size(0), dv = rec_state.size(3), K = conv_w.size(1), W = K - 1;
    TORCH_CHECK(rec_state.size(1) == H && rec_state.size(2) == dk && dv == dk, "kda_decode: recurrent state shape");
    TORCH_CHECK(conv_state.size(0) == S && conv_state.size(1) == C3 && conv_state.size(2) == W, "kda_decode: conv state shape");
    TORCH_CHECK(W >= 0 && W <= 8, "kda_decode: conv kernel size ", K, " outside 1..9");
    const bool per_token = starts.numel() == 0;
    if (!per_token) check(starts, "starts", at::kLong);
    const int64_t N = per_token ? T : starts.numel() - 1;
    const int64_t* st = per_token ? nullptr : starts.data_ptr<int64_t>();
    TORCH_CHECK(f.size(1) == C && gate.size(1) == C && b.size(1) == H && slots.numel() == N && fresh.numel() == N &&
                norm_w.numel() == dv && (per_token || (N >= 0 && st[0] == 0 && st[N] == T)), "kda_decode: input shapes");
    const int64_t* sl = slots.data_ptr<int64_t>();
    for (int64_t n = 0; n < N; ++n) {
        TORCH_CHECK(sl[n] >= 0 && sl[n] < S, "kda_decode: slot ", sl[n], " outside [0, ", S, ")");
        TORCH_CHECK(per_token || st[n + 1] >= st[n], "kda_decode: starts must not decrease");
    }

    at::Tensor out = at::empty({T, C}, mixed.options());
    const float *xp = mixed.data_ptr<float>(), *fp = f.data_ptr<float>(), *bp = b.data_ptr<float>();
    const float *gp = gate.data_ptr<float>(), *wp = conv_w.data_ptr<float>(), *dtp = dt_bias.data_ptr<float>();
    const float *ap = A_log.data_ptr<float>(), *nw = norm_w.data_ptr<float>();
    const bool* fr = fresh.data_ptr<bool>();
    const int64_t xs = mixed.stride(0), fs = f.stride(0), bs = b.stride(0), gs = gate.stride(0);
    float *cs = conv_state.data_ptr<float>(), *rs = rec_state.data_ptr<float>(), *op = out.data_ptr<float>();
    const bool bounded = !std::isnan(lower_bound);
    TORCH_CHECK(!(lower_bound > 0), "kda_decode: lower_bound ", lower_bound, " > 0 (the gate is a log-decay)");
    const float lb = static_cast<float>(lower_bound), e = static_cast<float>(eps), qscale = 1.f / std::sqrt(float(dk));

    // the conv weights as rows [K][3C], once for every (sequence, head) task
    std::vector<float> wt(K * C3);
    window_to_rows(wp, C3, K, wt.data());
    // a (token, head) task is ~4 dk dv flops on a dk x dv state read and written from memory, not cache
    // (a decode step reads more than L3 holds): a thread takes at least ~64 KB of states (4 heads of
    // 64 x 64; 16 tasks before, which ran a batch-1 step of `small`'s 8 heads on one thread); a
    // sequence's tokens run in order inside one task
    const int64_t grain = per_token ? std::max<int64_t>(1, (int64_t(1) << 14) / (dk * dv)) : 1;
    at::parallel_for(0, N * H, grain, [&](int64_t i0, int64_t i1) {
        std::vector<float> buf(8 * dk), hist(3 * W * dk);
        float *q = buf.data(), *k = q + dk, *v = k + dk, *g = v + dk, *pred = g + dk, *o = pred + dk;
        float *tmp = o + dk, *raw = tmp + dk;
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t n = i / H, h = i % H, slot = sl[n];
          float* Sh = rs + ((slot * H) + h) * dk * dv;
          if (fr[n]) {
              std::fill(Sh, Sh + dk * dv, 0.f);
              for (int p = 0; p < 3; ++p) {
                  float* win = cs + (slot * C3 + p * C + h * dk) * W;
                  std::fill(win, win + dk * W, 0.f);
              }
          }
          const int64_t t0 = per_token ? n : st[n], t1 = per_token ? n + 1 : st[n + 1];
          // this head's q, k and v channels (dk of each, contiguous): the window as rows
          Conv conv[3];
          for (int p = 0; p < 3; ++p) {
              const int64_t c0 = p * C + h * dk;
              window_to_rows(cs + (slot * C3 + c0) * W, dk, W, hist.data() + p * W * dk);
              conv[p] = Conv{hist.data() + p * W * dk, wt.data() + c0, dk, W, C3};
          }
          for (int64_t t = t0; t < t1; ++t) {
            // a later token's rows of this head, fetched ahead: a task walks its tokens at the rows'
            // stride (kilobytes apart, six streams), where the hardware's prefetch fell behind
            if (t + PREFETCH_TOKENS < t1) {
                const int64_t a = t + PREFETCH_TOKENS;
                for (int p = 0; p < 3; ++p) ouro::prefetch(xp + a * xs + p * C + h * dk, dk * 4);
                ouro::prefetch(fp + a * fs + h * dk, dk * 4);
                ouro::prefetch(gp + a * gs + h * dv, dv * 4);
                ouro::prefetch(bp + a * bs + h, 4);
            }
            // conv step of this head's q, k and v channels, then SiLU
            float* parts[3] = {q, k, v};
            for (int p = 0; p < 3; ++p) {
                const int64_t c0 = p * C + h * dk;
                conv[p].step(t, t0, [&](int64_t s) { return xp + s * xs + c0; }, parts[p]);
                ouro::sigmoid_row(tmp, parts[p], dk);
                for (int64_t j = 0; j < dk; ++j) parts[p][j] *= tmp[j];
            }
            const float qn = 1.f / std::sqrt(ouro::sumsq(q, dk) + 1e-6f) * qscale;
            const float kn = 1.f / std::sqrt(ouro::sumsq(k, dk) + 1e-6f);
            for (int64_t j = 0; j < dk; ++j) { q[j] *= qn; k[j] *= kn; }
            // forget gate: the log-decay (<= 0: lower_bound <= 0, softplus >= 0), then its exp
            const float rate = std::exp(ap[h]);
            for (int64_t j = 0; j < dk; ++j) raw[j] = fp[t * fs + h * dk + j] + dtp[h * dk + j];
            if (bounded) {
                for (int64_t j = 0; j < dk; ++j) g[j] = rate * raw[j];
                ouro::sigmoid_row(g, g, dk);
                for (int64_t j = 0; j < dk; ++j) g[j] *= lb;
            } else {
                for (int64_t j = 0; j < dk; ++j) g[j] = -rate * softplus(raw[j]);
            }
            ouro::exp_nonpos_row(g, g, dk);
            const float beta = ouro::sigmoid(bp[t * bs + h]);
            // sweep 1: decay each key row, recall pred = k^T S
            ouro::rows_scale_tdot(Sh, dk, dv, dv, g, k, pred);
            for (int64_t c = 0; c < dv; ++c) pred[c] = beta * (v[c] - pred[c]);      // u
            // sweep 2: the rank-1 update, and the output from the updated rows
            ouro::rows_rank1_tdot(Sh, dk, dv, dv, k, pred, q, o);
            // gated RMSNorm: weight * (o * rsqrt(mean(o^2) + eps)) * sigmoid(gate)
            const float inv = 1.f / std::sqrt(ouro::sumsq(o, dv) / float(dv) + e);
            float* y = op + t * C + h * dv;
            ouro::sigmoid_row(tmp, gp + t * gs + h * dv, dv);
            for (int64_t c = 0; c < dv; ++c) y[c] = nw[c] * (o[c] * inv) * tmp[c];
          }
          // each window takes the sequence's last W inputs (older ones from itself where it is short)
          for (int p = 0; p < 3; ++p) {
              const int64_t c0 = p * C + h * dk;
              float* win = cs + (slot * C3 + c0) * W;
              for (int64_t m = 0; m < W; ++m) {
                  const int64_t s = t1 - W + m;
                  const float* src = s >= t0 ? xp + s * xs + c0 : conv[p].hist + (W - (t0 - s)) * dk;
                  for (int64_t j = 0; j < dk; ++j) win[j * W + m] = src[j];
              }
          }
        }
    });
    return out;
}

// float32 inside: a bfloat16 model's projections and small weights converted at the boundary, the
// output returned in the projections' dtype (`boundary.h`); the states are float32 in every model
at::Tensor kda_boundary(const at::Tensor& mixed, const at::Tensor& f, const at::Tensor& b, const at::Tensor& gate,
                        const at::Tensor& conv_w, const at::Tensor& dt_bias, const at::Tensor& A_log,
                        double lower_bound, const at::Tensor& norm_w, double eps, at::Tensor& conv_state,
                        at::Tensor& rec_state, const at::Tensor& slots, const at::Tensor& fresh, const at::Tensor& starts) {
    using ouro::f32;
    return ouro::as_dtype(kda_sequences(f32(mixed), f32(f), f32(b), f32(gate), f32(conv_w), f32(dt_bias), f32(A_log),
                                        lower_bound, f32(norm_w), eps, conv_state, rec_state, slots, fresh, starts),
                          f.scalar_type());
}

at::Tensor kda_decode(const at::Tensor& mixed, const at::Tensor& f, const at::Tensor& b, const at::Tensor& gate,
                      const at::Tensor& conv_w, const at::Tensor& dt_bias, const at::Tensor& A_log,
                      double lower_bound, const at::Tensor& norm_w, double eps,
                      at::Tensor& conv_state, at::Tensor& rec_state, const at::Tensor& slots, const at::Tensor& fresh) {
    return kda_boundary(mixed, f, b, gate, conv_w, dt_bias, A_log, lower_bound, norm_w, eps, conv_state, rec_state,
                        slots, fresh, at::empty({0}, slots.options()));
}

at::Tensor kda_prefill(const at::Tensor& mixed, const at::Tensor& f, const at::Tensor& b, const at::Tensor& gate,
                       const at::Tensor& conv_w, const at::Tensor& dt_bias, const at::Tensor& A_log,
                       double lower_bound, const at::Tensor& norm_w, double eps, at::Tensor& conv_state,
                       at::Tensor& rec_state, const at::Tensor& slots, const at::Tensor& fresh, const at::Tensor& starts) {
    TORCH_CHECK(starts.dim() == 1 && starts.numel() >= 1, "kda_prefill: starts must be [N + 1]");
    return kda_boundary(mixed, f, b, gate, conv_w, dt_bias, A_log, lower_bound, norm_w, eps, conv_state, rec_state,
                        slots, fresh, starts);
}

std::string kda_isa(int64_t force_portable) { return ouro::isa_switch(force_portable); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(ouro_native, m) {
    m.def("kda_decode(Tensor mixed, Tensor f, Tensor b, Tensor gate, Tensor conv_w, Tensor dt_bias, Tensor A_log, "
          "float lower_bound, Tensor norm_w, float eps, Tensor(a!) conv_state, Tensor(b!) rec_state, Tensor slots, "
          "Tensor fresh) -> Tensor");
    m.def("kda_prefill(Tensor mixed, Tensor f, Tensor b, Tensor gate, Tensor conv_w, Tensor dt_bias, Tensor A_log, "
          "float lower_bound, Tensor norm_w, float eps, Tensor(a!) conv_state, Tensor(b!) rec_state, Tensor slots, "
          "Tensor fresh, Tensor starts) -> Tensor");
    m.def("kda_isa(int force_portable) -> str", &kda_isa);
}

TORCH_LIBRARY_IMPL(ouro_native, CPU, m) {
    m.impl("kda_decode", &kda_decode);
    m.impl("kda_prefill", &kda_prefill);
}
