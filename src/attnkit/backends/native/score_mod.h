// The hook for a compiled Python score_mod (generated and built by score_mod.py, loaded
// with ctypes; see attention.cpp for the legend). The generated function is
//   void mod(A* x, A* dx, int64_t n, int64_t b, int64_t h, int64_t q, int64_t k0,
//            const void* const* caps, double scale)
// x[j] <- score_mod(x[j] * scale, b, h, q, k0 + j) for j < n, in place (scale: the call's
// when the mod takes the raw scores, 1 for scores already scaled); when dx is not null also
// dx[j] <- d score_mod / d score at x[j] (forward-mode, from the same graph); caps are the
// data pointers of the tensors the score_mod captured.
#pragma once
#include <cstdint>
#include <type_traits>

namespace attnkit_native {
namespace {

// One function per compute type: float rows for float32 / bfloat16 / float16 inputs, double
// rows for float64 inputs (score_mod.py generates the matching one).
template <typename A>
using ScoreModFn = void (*)(A*, A*, int64_t, int64_t, int64_t, int64_t, int64_t,
                            const void* const*, double);

// Row x (n,) of head h, query qi over keys [k0, k0 + n): the score_mod in place, on x *
// scale (1: x already scaled). With fac (the backward's chain-rule factor d(capped)/d(score),
// (n,)), fac *= d mod / d(capped).
template <typename Args, typename F>
inline void apply_score_mod(const Args& a, F* x, typename std::common_type<F>::type* fac,
                            int64_t n, int64_t b, int64_t h, int64_t qi, int64_t k0,
                            double scale = 1.0) {
  if (!a.mod) return;
  if (!fac) return a.mod(x, nullptr, n, b, h, qi, k0, a.mod_caps, scale);
  F dm[512];                                  // with fac (the backward): n <= BK = 128 keys
  a.mod(x, dm, n, b, h, qi, k0, a.mod_caps, scale);
  for (int64_t j = 0; j < n; ++j) fac[j] *= dm[j];
}

}  // namespace
}  // namespace attnkit_native
