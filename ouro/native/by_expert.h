// The (token, choice) pairs of a routed-experts call ordered by expert: the stable counting sort
// both expert kernels share (`experts.cpp`, `quant/int8_mm.cpp`), the order of the eager path's
// `by_expert` (argsort, stable). Pair n = token * k + choice.
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <vector>

namespace ouro {

struct ExpertOrder {
    std::vector<int64_t> start;   // [E + 1]: rows start[e] .. start[e+1] are expert e's
    std::vector<int64_t> pos;     // [T * k]: pair n's row
    std::vector<int64_t> token;   // [T * k]: row r's token
};

inline ExpertOrder order_by_expert(const int64_t* ex, int64_t pairs, int64_t k, int64_t E, const char* op) {
    ExpertOrder o{std::vector<int64_t>(E + 1, 0), std::vector<int64_t>(pairs), std::vector<int64_t>(pairs)};
    for (int64_t n = 0; n < pairs; ++n) {
        TORCH_CHECK(ex[n] >= 0 && ex[n] < E, op, ": expert id ", ex[n], " outside [0, ", E, ")");
        ++o.start[ex[n] + 1];
    }
    for (int64_t e = 0; e < E; ++e) o.start[e + 1] += o.start[e];
    std::vector<int64_t> fill(o.start.begin(), o.start.end() - 1);
    for (int64_t n = 0; n < pairs; ++n) {
        o.pos[n] = fill[ex[n]]++;
        o.token[o.pos[n]] = n / k;
    }
    return o;
}

}  // namespace ouro
