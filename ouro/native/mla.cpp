// DSA decode as two ops: the lightning indexer's pool scores and top-k selection, and the sparse
// absorbed MLA over the selected latent rows, both reading the paged cache in place through the page
// table (no [n, W, r] gather of latents nor [n, P, d] gather of pool keys in torch).
//
// sparse_mla_decode: per (request, head block) the selected rows are read once, a tile of them at a
// time (dequantised row by row from int8 / fp8 cache rows into the tile), for all the block's heads:
// scores, an online max-subtracted float32 softmax, the weighted sum. The tile size is fixed, so a
// head's result depends on nothing but its own inputs (not the batch, not the head blocking).
// index_select_decode: the eager `index_select` row by row: pool scores relu(q.k * scale) weighted
// over heads, the best `select_k` visible pools (ties to the earlier pool), listed in pool order and
// expanded to tokens, then the incomplete tail pool in the last kpool-1 columns.
// pool_keys_write: the indexer's compressed key of each pool the batch completes, from its tokens'
// keys and gates read in place, written to the pool's row (one call a layer, not a gather, a softmax
// and a scatter in torch).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "boundary.h"
#include "vec.h"

namespace {

constexpr int64_t TILE = 32;                 // latent rows per tile (32 x 512 floats = 64 KB)
constexpr int64_t GRAIN_MACS = 1 << 17;      // multiply-adds a thread's share must be worth at least
constexpr float NaN = std::numeric_limits<float>::quiet_NaN();

// float8 e4m3fn (bias 7, no infinities, S.1111.111 is NaN) -> float, all 256 codes
struct Fp8Table {
    float v[256];
    Fp8Table() {
        for (int b = 0; b < 256; ++b) {
            const int e = (b >> 3) & 15, m = b & 7;
            float x = e == 0 ? std::ldexp(float(m) / 8.f, -6) : std::ldexp(1.f + float(m) / 8.f, e - 7);
            if (e == 15 && m == 7) x = NaN;
            v[b] = (b & 128) ? -x : x;
        }
    }
};
const Fp8Table& fp8() { static const Fp8Table t; return t; }

enum Kind { FLOAT = 0, INT8 = 1, FP8 = 2 };

Kind kind_of(const std::string& kind) {
    if (kind.empty()) return FLOAT;
    if (kind == "int8") return INT8;
    if (kind == "fp8_e4m3") return FP8;
    TORCH_CHECK(false, "unknown cache row kind '", kind, "' (expected '', 'int8' or 'fp8_e4m3')");
}

// A cache layer viewed flat: float32 or bfloat16 rows [R, r], or quantised rows [R, r + 4 * groups] of
// bytes (values, then one float32 scale per `group` values: ops/quant/kv_rows.py's layout)
struct Rows {
    const float* f = nullptr;
    const ouro::bf16_t* b = nullptr;     // a bfloat16 model's rows: widened into buf (exact)
    const uint8_t* q = nullptr;
    int64_t stride = 0, r = 0, group = 0, count = 0;
    Kind kind = FLOAT;

    // the row's values: the cache's own memory, or widened or dequantised into buf (values * scale, as torch)
    const float* get(int64_t i, float* buf) const {
        if (f != nullptr) return f + i * stride;
        if (b != nullptr) {
            for (int64_t j = 0; j < r; ++j) buf[j] = ouro::to_float(b[i * stride + j]);
            return buf;
        }
        const uint8_t* row = q + i * stride;
        const uint8_t* scales = row + r;
        for (int64_t g0 = 0, gi = 0; g0 < r; g0 += group, ++gi) {
            float s;
            std::memcpy(&s, scales + 4 * gi, 4);
            const int64_t g1 = std::min(r, g0 + group);
            if (kind == INT8)
                for (int64_t j = g0; j < g1; ++j) buf[j] = float(int8_t(row[j])) * s;
            else
                for (int64_t j = g0; j < g1; ++j) buf[j] = fp8().v[row[j]] * s;
        }
        return buf;
    }
};

Rows rows_of(const at::Tensor& t, const std::string& kind, int64_t r, int64_t group) {
    TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, "cache rows must be [rows, width] with contiguous rows");
    Rows rows;
    rows.kind = kind_of(kind);
    rows.r = r, rows.group = group, rows.stride = t.stride(0), rows.count = t.size(0);
    if (rows.kind == FLOAT) {
        TORCH_CHECK((t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16) && t.size(1) == r,
                    "float cache rows must be float32 or bfloat16 [rows, ", r, "]");
        if (t.scalar_type() == at::kFloat)
            rows.f = t.data_ptr<float>();
        else
            rows.b = static_cast<const ouro::bf16_t*>(t.data_ptr());
    } else {
        TORCH_CHECK(group > 0 && t.scalar_type() == at::kByte && t.size(1) == r + 4 * ((r + group - 1) / group),
                    "quantised cache rows must be uint8 [rows, r + 4 * ceil(r / group)]");
        rows.q = t.data_ptr<uint8_t>();
    }
    return rows;
}

// Token positions of one sequence -> flat cache rows through its page-table row
struct Pages {
    const int64_t* table;
    int64_t stride, width, page_size;
    int shift;                          // log2(page_size) where a power of two (a shift, not a division a row), else -1
    int64_t row(const int64_t* seq_pages, int64_t tok) const {
        if (shift >= 0) return seq_pages[tok >> shift] * page_size + (tok & (page_size - 1));
        return seq_pages[tok / page_size] * page_size + tok % page_size;
    }
    // the pool-key row of the pool starting at token `first` (a multiple of kpool, which divides page_size)
    int64_t pool_row(const int64_t* seq_pages, int64_t first, int64_t kpool) const { return row(seq_pages, first) / kpool; }
};

Pages pages_of(const at::Tensor& table, int64_t page_size) {
    TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 2 && table.stride(1) == 1,
                "page_table must be int64 [B, pages]");
    TORCH_CHECK(page_size > 0, "page_size must be positive");
    const int shift = (page_size & (page_size - 1)) == 0 ? __builtin_ctzll(uint64_t(page_size)) : -1;
    return {table.data_ptr<int64_t>(), table.stride(0), table.size(1), page_size, shift};
}

void check_long(const at::Tensor& t, int64_t n, const char* what) {
    TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 1 && t.size(0) == n && t.is_contiguous(),
                what, " must be contiguous int64 [", n, "]");
}

int64_t grain(int64_t work_per_task) { return std::max<int64_t>(1, GRAIN_MACS / std::max<int64_t>(1, work_per_task)); }

// scores s[h * TILE + t] = q[h] . row[t] for h < nh, t < nt, through dot_2x4 (short groups padded
// with repeats: each score is summed in one order wherever it sits)
void tile_scores(const float* const* qh, int64_t nh, const float* const* row, int64_t nt, int64_t r, float* s) {
    float out[8];
    for (int64_t h = 0; h < nh; h += 2) {
        const float* a[2] = {qh[h], qh[std::min(h + 1, nh - 1)]};
        for (int64_t t = 0; t < nt; t += 4) {
            const float* b[4];
            for (int k = 0; k < 4; ++k) b[k] = row[std::min(t + k, nt - 1)];
            ouro::dot_2x4(a, b, r, out);
            for (int i = 0; i < 2 && h + i < nh; ++i)
                for (int k = 0; k < 4 && t + k < nt; ++k) s[(h + i) * TILE + t + k] = out[i * 4 + k];
        }
    }
}

// o [n, H, r] = softmax_w(q_lat . latent[w]) weighted sum of latent[w], over each request's selected
// tokens (tokens [n, W], -1 unused) of sequence seq[n] (a row of page_table). q_lat is already scaled;
// its rows are read where they are (the absorbed product's output is [H, n, r] seen as [n, H, r]).
at::Tensor sparse_mla_decode(const at::Tensor& q_in, const at::Tensor& latents, const std::string& kind, int64_t group,
                             const at::Tensor& tokens_in, const at::Tensor& page_table, const at::Tensor& seq,
                             int64_t page_size) {
    TORCH_CHECK(q_in.scalar_type() == at::kFloat && q_in.dim() == 3, "q_lat must be float32 [n, H, r]");
    at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous(), tokens = tokens_in.contiguous();
    const int64_t n = q.size(0), H = q.size(1), r = q.size(2), qs0 = q.stride(0), qs1 = q.stride(1);
    TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.dim() == 2 && tokens.size(0) == n,
                "tokens must be int64 [n, W]");
    check_long(seq, n, "seq");
    const Rows rows = rows_of(latents, kind, r, group);
    const Pages pages = pages_of(page_table, page_size);
    const int64_t W = tokens.size(1);
    at::Tensor o = at::empty({n, H, r}, q.options());
    const float* qp = q.data_ptr<float>();
    const int64_t *tp = tokens.data_ptr<int64_t>(), *sp = seq.data_ptr<int64_t>();
    float* op = o.data_ptr<float>();
    // few requests: split the heads too, so every thread has a share (blocks of even size: dot_2x4 pairs)
    const int64_t threads = at::get_num_threads();
    int64_t blocks = n >= threads ? 1 : std::min<int64_t>((H + 1) / 2, (threads + n - 1) / n);
    const int64_t hb = ((H + blocks - 1) / blocks + 1) / 2 * 2;
    blocks = (H + hb - 1) / hb;
    at::parallel_for(0, n * blocks, grain(W * hb * r * 2), [&](int64_t t0, int64_t t1) {
        std::vector<float> buf(rows.f != nullptr ? 0 : TILE * r), s(hb * TILE), a(hb), m(hb), l(hb);
        std::vector<const float*> row(TILE), qh(hb);
        std::vector<int64_t> flat(W);
        for (int64_t task = t0; task < t1; ++task) {
            const int64_t i = task / blocks, h0 = (task % blocks) * hb, nh = std::min(H, h0 + hb) - h0;
            TORCH_CHECK(sp[i] >= 0 && sp[i] < page_table.size(0), "seq ", sp[i], " out of the page table");
            const int64_t* seq_pages = pages.table + sp[i] * pages.stride;
            int64_t m_rows = 0;
            for (int64_t w = 0; w < W; ++w) {
                const int64_t tok = tp[i * W + w];
                if (tok < 0) continue;
                TORCH_CHECK(tok / page_size < pages.width, "token ", tok, " beyond the page table");
                const int64_t fr = pages.row(seq_pages, tok);
                TORCH_CHECK(fr >= 0 && fr < rows.count, "cache row ", fr, " out of range");
                flat[m_rows++] = fr;
            }
            for (int64_t h = 0; h < nh; ++h) {
                qh[h] = qp + i * qs0 + (h0 + h) * qs1;
                float* acc = op + (i * H + h0 + h) * r;
                std::fill(acc, acc + r, m_rows ? 0.f : NaN);       // nothing selected: softmax of no scores
                m[h] = -std::numeric_limits<float>::infinity();
                l[h] = 0.f;
            }
            for (int64_t w0 = 0; w0 < m_rows; w0 += TILE) {
                const int64_t nt = std::min(TILE, m_rows - w0);
                for (int64_t t = 0; t < nt; ++t)
                    row[t] = rows.get(flat[w0 + t], rows.f != nullptr ? nullptr : buf.data() + t * r);
                tile_scores(qh.data(), nh, row.data(), nt, r, s.data());
                for (int64_t h = 0; h < nh; ++h) {                  // online softmax: p = e^(s - max so far)
                    float* sh = s.data() + h * TILE;
                    float mx = m[h];
                    for (int64_t t = 0; t < nt; ++t) mx = std::max(mx, sh[t]);
                    for (int64_t t = 0; t < nt; ++t) sh[t] -= mx;
                    a[h] = m[h] - mx;
                    m[h] = mx;
                    ouro::exp_nonpos_row(sh, sh, nt);
                }
                ouro::exp_nonpos_row(a.data(), a.data(), nh);       // rescales what earlier tiles summed
                for (int64_t h = 0; h < nh; ++h) {
                    float sum = 0.f;
                    for (int64_t t = 0; t < nt; ++t) sum += s[h * TILE + t];
                    l[h] = l[h] * a[h] + sum;
                }
                for (int64_t h = 0; h < nh; h += 4) {               // acc = a * acc + sum_t p_t row_t, 4 heads a pass
                    float* y[4];
                    float a4[4];
                    const float* c4[4];
                    for (int j = 0; j < 4; ++j) {
                        const int64_t hj = std::min(h + j, nh - 1);
                        y[j] = op + (i * H + h0 + hj) * r;
                        a4[j] = a[hj];
                        c4[j] = s.data() + hj * TILE;
                    }
                    ouro::rescale_lincomb_4(y, a4, c4, row.data(), nt, r);
                }
            }
            if (m_rows)
                for (int64_t h = 0; h < nh; ++h) {
                    float* acc = op + (i * H + h0 + h) * r;
                    const float inv = 1.f / l[h];
                    for (int64_t j = 0; j < r; ++j) acc[j] *= inv;
                }
        }
    });
    return o;
}

// A score as an integer that orders as the selection does: higher scores above lower (the float's
// bits made monotone, -0 as +0), every NaN above everything (as torch.topk ranks it)
inline uint32_t rank_of(float x) {
    if (std::isnan(x)) return 0xFFFFFFFFu;
    x += 0.f;                           // -0 -> +0: they compare equal as floats
    uint32_t b;
    std::memcpy(&b, &x, 4);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// chosen[p] = 1 for the k (0 < k < n) highest ranks, ties to the earlier p. Few left out (a decode
// context just past what top-k keeps): the n - k lowest, ties to the later p, by insertion into a
// short list. Otherwise the k-th highest rank found bit by bit from the top (each step counts the
// ranks at or above a candidate: a loop the compiler vectorises, no data-dependent branches, but 32
// passes with a horizontal sum each), then every rank above it and the earliest of those equal to it
constexpr int64_t FEW_LEFT_OUT = 8;
inline void choose_best(const uint32_t* rank, int64_t n, int64_t k, char* chosen) {
    if (n - k <= FEW_LEFT_OUT) {
        const int64_t m = n - k;
        uint32_t low[FEW_LEFT_OUT];     // ascending by (rank, later p first)
        int64_t at[FEW_LEFT_OUT];
        int64_t c = 0;
        for (int64_t p = 0; p < n; ++p) {
            const uint32_t r = rank[p];
            if (c == m && r > low[m - 1]) continue;      // an equal rank at a later p sits lower
            int64_t j = c < m ? c++ : m - 1;
            while (j > 0 && low[j - 1] >= r) {
                low[j] = low[j - 1], at[j] = at[j - 1];
                --j;
            }
            low[j] = r, at[j] = p;
        }
        std::fill(chosen, chosen + n, char(1));
        for (int64_t j = 0; j < m; ++j) chosen[at[j]] = 0;
        return;
    }
    uint32_t t = 0;
    for (int bit = 31; bit >= 0; --bit) {
        const uint32_t cand = t | (1u << bit);
        uint32_t at_least = 0;          // (32-bit lanes: the count vectorises at full width)
        for (int64_t p = 0; p < n; ++p) at_least += rank[p] >= cand;
        if (int64_t(at_least) >= k) t = cand;
    }
    int64_t above = 0;
    for (int64_t p = 0; p < n; ++p) above += rank[p] > t;
    int64_t room = k - above;           // >= 1: t is the k-th highest
    for (int64_t p = 0; p < n; ++p) {
        const bool tie = rank[p] == t && room > 0;
        room -= tie;
        chosen[p] = char(rank[p] > t || tie);
    }
}

// [n, width] token positions each decode query attends to (see the file's head); pooled: the cache's
// pool keys [pool rows, d] float32, pool p of a sequence at row (its first token's cache row) / kpool
at::Tensor index_select_decode(const at::Tensor& q_in, const at::Tensor& w_in, const at::Tensor& pooled,
                               const at::Tensor& page_table, const at::Tensor& seq, const at::Tensor& positions,
                               int64_t page_size, int64_t select_k, int64_t kpool, double scale, int64_t width) {
    // a bfloat16 model's queries widened at the boundary (`boundary.h`); the pool keys are float32 in every model
    TORCH_CHECK((q_in.scalar_type() == at::kFloat || q_in.scalar_type() == at::kBFloat16) && q_in.dim() == 3,
                "q must be float32 or bfloat16 [n, Hi, d]");
    at::Tensor q = ouro::f32(q_in).contiguous(), w = w_in.contiguous();
    const int64_t n = q.size(0), Hi = q.size(1), d = q.size(2);
    TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2 && w.size(0) == n && w.size(1) == Hi,
                "weights must be float32 [n, Hi]");
    TORCH_CHECK(pooled.scalar_type() == at::kFloat && pooled.dim() == 2 && pooled.size(1) == d && pooled.stride(1) == 1,
                "pooled must be float32 [pool rows, d]");
    check_long(seq, n, "seq");
    check_long(positions, n, "positions");
    TORCH_CHECK(kpool >= 1 && page_size % kpool == 0, "page_size must be a multiple of kpool");
    TORCH_CHECK(select_k >= 0 && select_k * kpool + kpool - 1 <= width, "width must hold select_k pools and the tail");
    const Pages pages = pages_of(page_table, page_size);
    at::Tensor out = at::empty({n, width}, q.options().dtype(at::kLong));
    const float *qp = q.data_ptr<float>(), *wp = w.data_ptr<float>(), *kp = pooled.data_ptr<float>();
    const int64_t *sp = seq.data_ptr<int64_t>(), *pp = positions.data_ptr<int64_t>();
    int64_t* op = out.data_ptr<int64_t>();
    const int64_t ks = pooled.stride(0);
    const float sc = static_cast<float>(scale);
    int64_t most = 0;
    for (int64_t i = 0; i < n; ++i) most = std::max(most, (pp[i] + 1) / kpool);
    at::parallel_for(0, n, grain(most * Hi * d), [&](int64_t i0, int64_t i1) {
        std::vector<float> score(most);
        std::vector<uint32_t> order(most);
        std::vector<char> chosen(most);
        std::vector<const float*> key(most);
        for (int64_t i = i0; i < i1; ++i) {
            const int64_t pos = pp[i], n_vis = (pos + 1) / kpool;
            TORCH_CHECK(pos >= 0 && sp[i] >= 0 && sp[i] < page_table.size(0), "bad position or sequence of row ", i);
            TORCH_CHECK(n_vis == 0 || ((n_vis - 1) * kpool) / page_size < pages.width,
                        "position ", pos, " beyond the page table");
            std::fill(chosen.begin(), chosen.begin() + n_vis, char(n_vis <= select_k));
            if (n_vis > select_k) {
                const int64_t* seq_pages = pages.table + sp[i] * pages.stride;
                const float* qi = qp + i * Hi * d;
                const float* wi = wp + i * Hi;
                // each visible pool's key row, a page at a time (a page holds page_size / kpool
                // consecutive pools: no division a pool)
                const int64_t per_page = page_size / kpool;
                for (int64_t p = 0, pg = 0; p < n_vis; ++pg) {
                    const float* base = kp + seq_pages[pg] * per_page * ks;
                    for (int64_t j = 0; j < per_page && p < n_vis; ++j, ++p) key[p] = base + j * ks;
                }
                float dots[16];
                for (int64_t p0 = 0; p0 < n_vis; p0 += 4) {          // 4 heads x 4 pools per pass
                    const float* b[4];
                    for (int k = 0; k < 4; ++k) b[k] = key[std::min(p0 + k, n_vis - 1)];
                    float acc[4] = {0.f, 0.f, 0.f, 0.f};
                    for (int64_t h = 0; h < Hi; h += 4) {            // short groups padded with the last head
                        const float* a[4];
                        for (int j = 0; j < 4; ++j) a[j] = qi + std::min(h + j, Hi - 1) * d;
                        ouro::dot_4x4(a, b, d, dots);
                        for (int j = 0; j < 4 && h + j < Hi; ++j)
                            for (int k = 0; k < 4; ++k) acc[k] += wi[h + j] * std::max(dots[j * 4 + k] * sc, 0.f);
                    }
                    for (int k = 0; k < 4 && p0 + k < n_vis; ++k) score[p0 + k] = acc[k];
                }
                // the select_k best, ties to the earlier pool (NaN ranks first, as in torch.topk)
                for (int64_t p = 0; p < n_vis; ++p) order[p] = rank_of(score[p]);
                if (select_k > 0) choose_best(order.data(), n_vis, select_k, chosen.data());
            }
            int64_t* row = op + i * width;
            int64_t col = 0;
            for (int64_t p = 0; p < n_vis; ++p)
                if (chosen[p])
                    for (int64_t j = 0; j < kpool; ++j) row[col++] = p * kpool + j;
            const int64_t tail0 = width - (kpool - 1);
            for (; col < tail0; ++col) row[col] = -1;
            for (int64_t j = 0; j < kpool - 1; ++j) {
                const int64_t t = n_vis * kpool + j;
                row[tail0 + j] = t > pos ? -1 : t;
            }
        }
    });
    return out;
}

// The compressed key of each pool that ends at ends[i] in sequence seq[i] (`ops.dsa.pool_keys`): per
// channel a softmax over the pool's kpool tokens of gate + ape, weighting their keys; keys (any cache
// row kind) and gates read in place through the page table, the result written to the pool's row of
// `pooled`. With `complete` (a graph names every token's pool, complete or not) only the rows it marks
// are computed and written: at decode a pool completes every kpool-th token, so the rest (three in
// four for `small`) were computed for a scratch row nobody reads.
void pool_keys_write(at::Tensor pooled, const at::Tensor& keys, const std::string& kind, int64_t group,
                     const at::Tensor& gates, const at::Tensor& ape_in, const at::Tensor& page_table,
                     const at::Tensor& seq, const at::Tensor& ends, const c10::optional<at::Tensor>& complete_in,
                     int64_t page_size) {
    TORCH_CHECK(pooled.scalar_type() == at::kFloat && pooled.dim() == 2 && pooled.stride(1) == 1,
                "pooled must be float32 [pool rows, d]");
    const int64_t d = pooled.size(1), n = seq.numel();
    const at::Tensor ape = ape_in.contiguous();
    TORCH_CHECK(ape.scalar_type() == at::kFloat && ape.dim() == 2 && ape.size(1) == d, "ape must be float32 [kpool, d]");
    const int64_t kpool = ape.size(0);
    TORCH_CHECK(kpool >= 1 && page_size % kpool == 0, "page_size must be a multiple of kpool");
    check_long(seq, n, "seq");
    check_long(ends, n, "ends");
    const bool* complete = nullptr;
    at::Tensor cm;
    if (complete_in.has_value()) {
        cm = complete_in->contiguous();
        TORCH_CHECK(cm.scalar_type() == at::kBool && cm.numel() == n, "complete must be bool [n]");
        complete = cm.data_ptr<bool>();
    }
    const Rows k_rows = rows_of(keys, kind, d, group), g_rows = rows_of(gates, "", d, 0);
    const Pages pages = pages_of(page_table, page_size);
    const int64_t *sp = seq.data_ptr<int64_t>(), *ep = ends.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) {       // checked up front: a bad row throws before anything is written
        const bool done = complete == nullptr || complete[i];
        TORCH_CHECK(sp[i] >= 0 && sp[i] < page_table.size(0), "pool ", i, ": sequence ", sp[i], " outside the page table");
        TORCH_CHECK(ep[i] >= (done ? kpool - 1 : 0) && ep[i] / page_size < pages.width, "pool ", i, ": end ", ep[i],
                    done ? " is not a complete pool's last token inside the page table" : " outside the page table");
        TORCH_CHECK(!done || (ep[i] + 1) % kpool == 0, "pool ", i, ": end ", ep[i], " is not a pool's last token");
    }
    std::vector<int64_t> todo;      // the rows whose pool is complete
    todo.reserve(n);
    for (int64_t i = 0; i < n; ++i)
        if (complete == nullptr || complete[i]) todo.push_back(i);
    const float* ap = ape.data_ptr<float>();
    float* out = pooled.data_ptr<float>();
    const int64_t ostride = pooled.stride(0);
    at::parallel_for(0, int64_t(todo.size()), grain(kpool * d * 8), [&](int64_t i0, int64_t i1) {
        std::vector<float> x(kpool * d), kb(kpool * d), gb(d), m(d), sum(d);
        std::vector<const float*> k(kpool);
        for (int64_t at = i0; at < i1; ++at) {
            const int64_t i = todo[at];
            const int64_t* seq_pages = pages.table + sp[i] * pages.stride;
            const int64_t t0 = ep[i] + 1 - kpool;
            for (int64_t j = 0; j < kpool; ++j) {
                const int64_t row = pages.row(seq_pages, t0 + j);
                k[j] = k_rows.get(row, kb.data() + j * d);
                const float* g = g_rows.get(row, gb.data());
                for (int64_t c = 0; c < d; ++c) x[j * d + c] = g[c] + ap[j * d + c];
            }
            // softmax over the pool's tokens, channel by channel (a NaN propagates through the max, as torch's)
            for (int64_t c = 0; c < d; ++c) m[c] = x[c];
            for (int64_t j = 1; j < kpool; ++j)
                for (int64_t c = 0; c < d; ++c) {
                    const float v = x[j * d + c];
                    m[c] = (v > m[c] || v != v) ? v : m[c];
                }
            for (int64_t j = 0; j < kpool; ++j)
                for (int64_t c = 0; c < d; ++c) x[j * d + c] -= m[c];
            ouro::exp_nonpos_row(x.data(), x.data(), kpool * d);
            for (int64_t c = 0; c < d; ++c) sum[c] = x[c];
            for (int64_t j = 1; j < kpool; ++j)
                for (int64_t c = 0; c < d; ++c) sum[c] += x[j * d + c];
            float* o = out + pages.pool_row(seq_pages, t0, kpool) * ostride;
            for (int64_t c = 0; c < d; ++c) o[c] = x[c] / sum[c] * k[0][c];
            for (int64_t j = 1; j < kpool; ++j)
                for (int64_t c = 0; c < d; ++c) o[c] += x[j * d + c] / sum[c] * k[j][c];
        }
    });
}

// dst[rows[i]] = src[i] for the rows of a 2-D cache layer (any element type), in place: a compiled
// decode graph writes its new cache rows through this op, which inductor keeps in place, where a
// functionalised index_put copied the whole cache layer out and back each step
void write_rows(at::Tensor dst, const at::Tensor& rows, const at::Tensor& src) {
    TORCH_CHECK(dst.dim() == 2 && dst.stride(1) == 1 && dst.device().is_cpu(), "write_rows: a 2-D CPU dst with unit column stride");
    TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong, "write_rows: int64 rows [n]");
    TORCH_CHECK(src.dim() == 2 && src.size(0) == rows.size(0) && src.size(1) == dst.size(1) &&
                src.scalar_type() == dst.scalar_type(), "write_rows: src [n, d] of dst's dtype and width");
    const auto r = rows.contiguous();
    const auto v = src.contiguous();
    const int64_t n = r.size(0), R = dst.size(0), bytes = dst.size(1) * dst.element_size();
    const int64_t* idx = r.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i)
        TORCH_CHECK(idx[i] >= 0 && idx[i] < R, "write_rows: row ", idx[i], " outside the ", R, " rows of dst");
    char* d = static_cast<char*>(dst.data_ptr());
    const char* s = static_cast<const char*>(v.data_ptr());
    const int64_t stride = dst.stride(0) * dst.element_size();
    for (int64_t i = 0; i < n; ++i) std::memcpy(d + idx[i] * stride, s + i * bytes, bytes);
}

std::string mla_isa(int64_t force_portable) { return ouro::isa_switch(force_portable); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(ouro_native, m) {
    m.def("sparse_mla_decode(Tensor q_lat, Tensor latents, str kind, int group, Tensor tokens, Tensor page_table, "
          "Tensor seq, int page_size) -> Tensor");
    m.def("index_select_decode(Tensor q, Tensor weights, Tensor pooled, Tensor page_table, Tensor seq, "
          "Tensor positions, int page_size, int select_k, int kpool, float scale, int width) -> Tensor");
    m.def("write_rows(Tensor(a!) dst, Tensor rows, Tensor src) -> ()");
    m.def("pool_keys_write(Tensor(a!) pooled, Tensor keys, str kind, int group, Tensor gates, Tensor ape, "
          "Tensor page_table, Tensor seq, Tensor ends, Tensor? complete, int page_size) -> ()");
    m.def("mla_isa(int force_portable) -> str", &mla_isa);
}

TORCH_LIBRARY_IMPL(ouro_native, CPU, m) {
    m.impl("sparse_mla_decode", &sparse_mla_decode);
    m.impl("index_select_decode", &index_select_decode);
    m.impl("write_rows", &write_rows);
    m.impl("pool_keys_write", &pool_keys_write);
}
