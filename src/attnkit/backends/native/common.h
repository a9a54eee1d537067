// Shared pieces of the native kernel: SIMD helpers, dtype conversion, the call's
// parameters, closed-form masks and the fused row pass (see attention.cpp for the legend).
// Everything computing runs in a compute type A: float for float32 / bfloat16 / float16
// inputs (W float lanes, the polynomial exp / tanh below), double for float64 inputs
// (W / 2 double lanes, std::exp / std::tanh per lane: exact rather than fast). The forward's
// two GEMMs may run in bfloat16 / float16 instead (lowp.h); everything else stays in A.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>

#if defined(__F16C__) || defined(__AVX__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "score_mod.h"

namespace attnkit_native {
namespace {

using at::Tensor;
using i64 = int64_t;

// ------------------------------------------------------------------ vectors (GCC/Clang)
#if defined(__AVX512F__)
constexpr int W = 16;
#elif defined(__AVX2__) || defined(__AVX__)
constexpr int W = 8;
#else
constexpr int W = 4;
#endif
typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
typedef double vd __attribute__((vector_size(W * 4)));   // W / 2 doubles, the same register
typedef decltype(vd{} < vd{}) vl;                        // its comparison mask

// The vector of compute type A and its lane count (W / 2 divides every padded length).
template <typename A> struct Lanes;
template <> struct Lanes<float> { using V = vf; static constexpr int L = W; };
template <> struct Lanes<double> { using V = vd; static constexpr int L = W / 2; };
template <typename A> using vec = typename Lanes<A>::V;
template <typename A> constexpr int lanes = Lanes<A>::L;
// float32 / bfloat16 / float16 inputs compute in float, float64 inputs in double.
template <typename T>
using compute_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr int BK = 128;  // keys per tile (a multiple of W)

// ------------------------------------------------------------------ aligned buffers
// Uninitialised arrays, and std::vector's storage, on 64-byte boundaries: brgemm's AMX tile
// rows are 64 bytes, and in glibc's own blocks (16 bytes past a line) every row load
// straddled two lines. The thread whose buffers were so placed ran its GEMMs ~30% slower:
// a two-thread bf16 forward took 58 ms, against 42 ms with aligned buffers.
struct FreeAligned {
  void operator()(void* x) const { std::free(x); }
};
template <typename T> using AlignedArray = std::unique_ptr<T[], FreeAligned>;
template <typename T> T* aligned_raw(size_t n) {
  void* x = std::aligned_alloc(64, (std::max<size_t>(n, 1) * sizeof(T) + 63) / 64 * 64);
  if (!x) throw std::bad_alloc();
  return static_cast<T*>(x);
}
template <typename T> AlignedArray<T> aligned_array(int64_t n) {
  return AlignedArray<T>(aligned_raw<T>(size_t(n)));
}
template <typename T> struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <typename U> Aligned64(const Aligned64<U>&) {}
  T* allocate(size_t n) { return aligned_raw<T>(n); }
  void deallocate(T* x, size_t) { std::free(x); }
  template <typename U> bool operator==(const Aligned64<U>&) const { return true; }
  template <typename U> bool operator!=(const Aligned64<U>&) const { return false; }
};
template <typename T> using avector = std::vector<T, Aligned64<T>>;

template <typename A> inline vec<A> splat(A x) { return vec<A>{} + x; }
template <typename A> inline vec<A> load(const A* p) {
  vec<A> v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <typename A> inline void store(A* p, vec<A> v) { std::memcpy(p, &v, sizeof v); }
template <typename V, typename M> inline V select(M c, V a, V b) { return c ? a : b; }
template <typename A> inline vec<A> iota() {
  vec<A> v;
  for (int i = 0; i < lanes<A>; ++i) v[i] = A(i);
  return v;
}
inline i64 round_up(i64 x, i64 m) { return (x + m - 1) / m * m; }
// |x| lane by lane: the sign bit cleared, one AND (a select on x < 0 is three ops with AVX2:
// compare, negate, blend); NaN stays NaN.
inline vf vabs(vf x) { return (vf)((vi)x & 0x7fffffff); }
inline vd vabs(vd x) { return (vd)((vl)x & 0x7fffffffffffffffLL); }
// The larger of a, b lane by lane; where b is NaN, a.
template <typename V> inline V vmax(V a, V b) { return b > a ? b : a; }
// The smaller of a, b lane by lane; where b is NaN, a.
template <typename V> inline V vmin(V a, V b) { return b < a ? b : a; }

// Horizontal sum / max by halving the vector (log2 W shuffles; values stay in registers).
typedef float v4f __attribute__((vector_size(16)));
inline v4f to4(vf v) {
#if defined(__AVX512F__)
  typedef float v8f __attribute__((vector_size(32)));
  v8f h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  v8f g = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  return __builtin_shufflevector(h + g, h + g, 0, 1, 2, 3) +
         __builtin_shufflevector(h + g, h + g, 4, 5, 6, 7);
#elif defined(__AVX2__) || defined(__AVX__)
  return __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
#else
  return v;
#endif
}
inline float hsum(vf v) {
  v4f x = to4(v);
  return (x[0] + x[2]) + (x[1] + x[3]);
}
// (by halving too: once per row and tile, and a lane-by-lane chain of W dependent maxima cost
// ~60 cycles a row, a soft-capped bf16 tile's largest single cost; every caller's v holds no
// NaN — vmax never takes one in — so any order gives the same lane)
inline float hmax(vf v) {
#if defined(__AVX512F__)
  typedef float v8f __attribute__((vector_size(32)));
  const v8f h = vmax(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7),
                     __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
  v4f x = vmax(__builtin_shufflevector(h, h, 0, 1, 2, 3), __builtin_shufflevector(h, h, 4, 5, 6, 7));
#elif defined(__AVX2__) || defined(__AVX__)
  v4f x = vmax(__builtin_shufflevector(v, v, 0, 1, 2, 3), __builtin_shufflevector(v, v, 4, 5, 6, 7));
#else
  v4f x = v;
#endif
  x = vmax(x, __builtin_shufflevector(x, x, 2, 3, 0, 1));
  x = vmax(x, __builtin_shufflevector(x, x, 1, 0, 3, 2));
  return x[0];
}
inline double hsum(vd v) {
  double s = v[0];
  for (int i = 1; i < W / 2; ++i) s += v[i];
  return s;
}
inline double hmax(vd v) {
  double m = v[0];
  for (int i = 1; i < W / 2; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

// e^x, ~1 ulp, for x in [-87.3, 88.3] (Cody-Waite range reduction, degree-6 polynomial).
inline vf vexp_core(vf x) {
  const vf magic = splat(12582912.f);                     // 1.5 * 2^23: round to nearest
  vf n = (x * 1.44269504f + magic) - magic;               // round(x / ln 2)
  vf r = x - n * 0.693359375f - n * -2.12194440e-4f;      // x - n ln 2 in two parts
  vf y = splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.f;
  vi bits = (__builtin_convertvector(n, vi) + 127) << 23;  // 2^n
  return y * (vf)bits;                                    // NaN -> NaN through y
}

// e^x for x <= 0 (softmax): exactly 0 below -87.3 and for -inf.
inline vf vexp_neg(vf x) {
  const vi tiny = x < -87.3f;
  return select(tiny, splat(0.f), vexp_core(select(tiny, splat(0.f), x)));
}

// tanh(x) to a few ulp over the whole range: an odd polynomial below 0.625, where
// 1 - 2/(e^2x + 1) would cancel (Cephes' tanhf), so c * tanh(x / c) stays accurate for
// caps up to 1e8; one division per lane. The argument is clamped at 10, where e^2f is finite
// and 1 - 2 / (e^20 + 1) rounds to 1 (as tanh does in float from 9.01 on: at 9 the form gives
// 1 - 1 ulp, so c * tanh(±inf) would miss ±c).
// The odd polynomial alone: tanh(x) for |x| < 0.625 (either sign).
inline vf vtanh_small(vf x) {
  const vf z = x * x;
  vf p = splat(-5.70498872745e-3f);
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  return p * z * x + x;
}

inline vf vtanh(vf x) {
  const vf f = vabs(x);
  const vf big = 1.f - 2.f / (vexp_core(select(f < 10.f, f, splat(10.f)) * 2.f) + 1.f);
  const vf r = select(f >= 0.625f, big, vtanh_small(f));  // NaN -> NaN through the polynomial
  return (vf)((vi)r | ((vi)x & INT32_MIN));               // x's sign on tanh(|x|)
}

// double: the C library per lane (e^x: 0 for -inf, NaN -> NaN; tanh exact at any size, so
// c * tanh(x / c) stays exact at large caps).
inline vd vexp_neg(vd x) {
  for (int i = 0; i < W / 2; ++i) x[i] = std::exp(x[i]);
  return x;
}
inline vd vtanh(vd x) {
  for (int i = 0; i < W / 2; ++i) x[i] = std::tanh(x[i]);
  return x;
}
inline vd vtanh_small(vd x) { return vtanh(x); }

// W / lanes<A> values at p as a vector of the compute type, converted in registers.
inline vf load_vec(const float* p) { return load(p); }
inline vd load_vec(const double* p) { return load(p); }
inline vf load_vec(const at::BFloat16* p) {              // bfloat16 = a float's top half
#if defined(__AVX512F__)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
#elif defined(__AVX2__)
  // one vpmovzxwd from memory and a shift (GCC's generic vector code widened the two
  // halves separately and joined them: six instructions per eight values instead of two)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
#else
  typedef uint16_t v16 __attribute__((vector_size(W * 2)));
  typedef uint32_t v32 __attribute__((vector_size(W * 4)));
  v16 h;
  std::memcpy(&h, p, sizeof h);
  return (vf)(__builtin_convertvector(h, v32) << 16);
#endif
}
inline vf load_vec(const at::Half* p) {
#if defined(__F16C__) && defined(__AVX512F__)
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__) && (defined(__AVX2__) || defined(__AVX__))
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  vf v;
  for (int i = 0; i < W; ++i) v[i] = float(p[i]);
  return v;
#endif
}

// bf16 loaded as they lie (32-bit lane i: dims 2i, 2i + 1) -> the floats of the even dims
// (x << 16) and of the odd dims (x & 0xffff0000), exact: the bf16 loops' pairs form.
#if defined(__AVX512F__)
inline void bf16_pairs(__m512i x, __m512& even, __m512& odd) {
  even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(int32_t(0xffff0000u))));
}
#endif
#if defined(__AVX2__)
inline void bf16_pairs(__m256i x, __m256& even, __m256& odd) {
  even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(int32_t(0xffff0000u))));
}
#endif

// ------------------------------------------------------------------ dtype conversion
// dst[0:n] = A(src[0:n]), dst[n:npad] = 0 (A = compute_t<T>).
template <typename T, typename A> inline void row_to_compute(const T* src, A* dst, i64 n,
                                                             i64 npad) {
  if constexpr (std::is_same_v<T, A>) {
    std::memcpy(dst, src, n * sizeof(A));
  } else {
    for (i64 i = 0; i < n; ++i) dst[i] = static_cast<A>(src[i]);
  }
  for (i64 i = n; i < npad; ++i) dst[i] = A(0);
}
// bfloat16 is the top half of a float32: widen and shift, W at a time.
template <> inline void row_to_compute<at::BFloat16, float>(const at::BFloat16* src, float* dst,
                                                            i64 n, i64 npad) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  i64 i = 0;
  for (; i + W <= n; i += W) store(dst + i, load_vec(src + i));
  for (; i < n; ++i) {
    uint32_t w = uint32_t(s[i]) << 16;
    std::memcpy(dst + i, &w, 4);
  }
  for (; i < npad; ++i) dst[i] = 0.f;
}
#if defined(__F16C__)
// float16 -> float32 in registers (vcvtph2ps), W at a time.
template <> inline void row_to_compute<at::Half, float>(const at::Half* src, float* dst, i64 n,
                                                        i64 npad) {
  i64 i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(src + i))));
#endif
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + i))));
  for (; i < n; ++i) dst[i] = float(src[i]);
  for (; i < npad; ++i) dst[i] = 0.f;
}
#endif

// A row in compute type (npad,): src itself for unpadded rows already in A, else converted
// into tmp.
template <typename T, typename A> inline const A* as_compute(const T* src, A* tmp, i64 n,
                                                             i64 npad) {
  if constexpr (std::is_same_v<T, A>) {
    if (n == npad) return src;
  }
  row_to_compute(src, tmp, n, npad);
  return tmp;
}

// Calls f with four rows of n values as the dot loops read them: the rows themselves when
// unpadded (n == npad; E = T, converted lane by lane in registers), else converted and
// zero-padded into tmp (4, npad) first (E = A).
template <typename T, typename A, typename F>
inline void as_rows4(const T* const (&src)[4], i64 n, i64 npad, A* tmp, F f) {
  if (n == npad) return f(src);
  const A* rows[4];
  for (int u = 0; u < 4; ++u) rows[u] = as_compute(src[u], tmp + u * npad, n, npad);
  f(rows);
}

// Ask for the row `ahead` keys on while this one is computed (decode is memory-bound),
// into L2 (prefetcht1): a prefetch into L1 holds one of L1's few miss buffers until the line
// arrives, and those ran out (the prefetches themselves stalled; fp32 decode on one core went
// from 0.45 to 0.60 of a plain sum's read bandwidth with the L2 hint).
template <typename T> inline void prefetch_row(const T* row, i64 n) {
  const char* p = reinterpret_cast<const char*>(row);
  for (i64 b = 0; b < n * i64(sizeof(T)); b += 64) __builtin_prefetch(p + b, 0, 2);
}

// A float format's bits as an unsigned integer and its exponent field: a value is inf or
// NaN exactly when every exponent bit is set.
template <typename T> struct FloatBits;
template <> struct FloatBits<float> { using U = uint32_t; static constexpr U E = 0x7F800000u; };
template <> struct FloatBits<double> {
  using U = uint64_t;
  static constexpr U E = 0x7FF0000000000000ull;
};
template <> struct FloatBits<at::BFloat16> { using U = uint16_t; static constexpr U E = 0x7F80; };
template <> struct FloatBits<at::Half> { using U = uint16_t; static constexpr U E = 0x7C00; };

// Whether any bit of v, a vector of the build's width (W * 4 bytes), is set: one vector test
// (an OR of the vector's lanes one by one, 16 extracts for float, was most of all_finite's
// time on a 64-value row: the forward's per-row screens of q and out rows took ~1.5% of a
// 512-key window's fp32 call).
template <typename V> inline bool any_bits(const V& v) {
  static_assert(sizeof(V) == W * 4, "a vector of the build's width");
#if defined(__AVX512F__)
  __m512i x;
  std::memcpy(&x, &v, 64);
  return _mm512_test_epi64_mask(x, x) != 0;
#elif defined(__AVX2__) || defined(__AVX__)
  __m256i x;
  std::memcpy(&x, &v, 32);
  return !_mm256_testz_si256(x, x);
#else
  uint64_t w[2];
  std::memcpy(w, &v, 16);
  return (w[0] | w[1]) != 0;
#endif
}

// Whether x (n,) holds no inf/NaN, from the bits: a vector of the build's width (W * 4 bytes:
// a 64-byte vector on an AVX2 build was compared lane by lane) at a time, two independent
// chains, no conversion (bf16 / fp16 are tested in their own format: 2W values per load).
// (It replaced lane sums of x * 0 in float: a chain of FMAs, and a widening per 16 values;
// a bf16 (1, 8, 2048, 64) K and V took 0.4 ms on one core.)
template <typename T> inline bool all_finite(const T* x, i64 n) {
  using U = typename FloatBits<T>::U;
  constexpr U E = FloatBits<T>::E;
  constexpr i64 VB = W * 4, L = VB / sizeof(U);             // bytes, values per vector
  typedef U VU __attribute__((vector_size(VB)));
  VU bad0 = {}, bad1 = {};
  i64 i = 0;
  for (; i + 2 * L <= n; i += 2 * L) {                     // values [i, i + 2L)
    VU u0, u1;
    std::memcpy(&u0, x + i, VB);
    std::memcpy(&u1, x + i + L, VB);
    bad0 |= (VU)((u0 & E) == E);
    bad1 |= (VU)((u1 & E) == E);
  }
  if (i + L <= n) {                                        // values [i, i + L)
    VU u0;
    std::memcpy(&u0, x + i, VB);
    bad0 |= (VU)((u0 & E) == E);
    i += L;
  }
  bool any = any_bits(bad0 | bad1);
  for (; i < n; ++i) {                                     // the tail, value by value
    U u;
    std::memcpy(&u, x + i, sizeof(U));
    any = any || (u & E) == E;
  }
  return !any;
}

// C (M, N) (+)= A (M, K) . B (K, N), row-major with leading dims: torch's brgemm for float,
// plain loops for double (brgemm has none; float64 is for exactness, not speed).
inline void gemm(i64 M, i64 N, i64 K, i64 lda, i64 ldb, i64 ldc, bool add, const float* a,
                 const float* b, float* c) {
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add, a, b, c, false);
}
inline void gemm(i64 M, i64 N, i64 K, i64 lda, i64 ldb, i64 ldc, bool add, const double* a,
                 const double* b, double* c) {
  for (i64 i = 0; i < M; ++i) {                            // row i of C (N,)
    double* ci = c + i * ldc;
    if (!add) std::fill(ci, ci + N, 0.0);
    for (i64 p = 0; p < K; ++p) {                          // += a[i, p] * row p of B (N,)
      const double aip = a[i * lda + p];
      const double* bp = b + p * ldb;
      for (i64 j = 0; j < N; ++j) ci[j] += aip * bp[j];
    }
  }
}

// ------------------------------------------------------------------ the call's parameters
// The score terms' values are in the compute type A (float, or double for float64 inputs).
template <typename A> struct Args {
  i64 B, Hq, Hkv, G, Nq, Nk, Dk, Dv, DKP, DVP;
  i64 sq[3], sk[3], sv[3];          // strides (batch, head, row) of q, k, v; last dim is 1
  A scale, softcap;                 // softcap 0 = none
  const A* alibi;                   // (H_q,) slopes or null
  A alibi_offset;                   // distance |q + offset - k|
  bool alibi_grad;                  // backward: also d slopes (H_q,)
  A* dbias;                         // backward: d bias (B, H_q, N_q, N_k) contiguous, or null
  const A* rel; i64 rel_M;          // (H_q, 2M+1) relative-position bias table, or null
  const A* bias; i64 sb[4];         // (B, H_q, N_q, N_k) broadcast strides, or null
  double band_lo, band_hi;          // allowed <=> lo <= q - k <= hi
  const i64* kv_len; i64 skl;       // (B,) or null; stride 0 when broadcast
  const i64* q_len; i64 sql;
  const i64* q_doc; i64 sqd[2];     // (B, N_q) document ids or null
  const i64* k_doc; i64 skd[2];
  const bool* mask; i64 sm[4];      // (B, H_q, N_q, N_k) broadcast strides, or null
  i64 rows, n_qblocks, splits, split_len;
  i64 NKP;                          // N_k rounded up to BK
  bool cache_kt;                    // keep a head's transposed K per thread (see Buffers)
  bool lowp, lowp_onednn_pack;      // forward: T GEMMs for bfloat16 / float16 (lowp.h)
  bool lowp_emulate;                // ... computed by emulated_brgemm (the test mode)
  ScoreModFn<A> mod; const void* const* mod_caps;  // a compiled Python score_mod or null
  // forward, when set: the eager path's NaN/inf screen, read as the kernel goes (a query row
  // holding inf/NaN as it is gathered, an output row as it is written) instead of one more
  // pass over q and over out each; set only ever to true, by any thread
  std::atomic<bool>* q_bad = nullptr;
  std::atomic<bool>* out_bad = nullptr;
  // ... and under a score_mod (a key it scores -inf still passes NaN on: the output's screen
  // cannot see it) a K or V row holding inf/NaN in a tile it reads (the eager path's K/V
  // screen; tiles the mask leaves empty are not read)
  std::atomic<bool>* kv_bad = nullptr;
};

// Whether the n rows x + j * ld (D values each) hold no inf/NaN: all_finite's bit test, over
// all n * D values at once when the rows follow one another (ld == D), else row by row. (It
// replaced lane sums of x * 0, one chain of FMAs: a tenth of the fp32 forward's own work
// outside the GEMMs and the row pass at a 512-key window, N = 8192, perf.)
template <typename T> inline bool rows_finite(const T* x, i64 ld, i64 n, i64 D) {
  if (ld == D) return all_finite(x, n * D);
  for (i64 j = 0; j < n; ++j)                              // row j (D,)
    if (!all_finite(x + j * ld, D)) return false;
  return true;
}

// Raises a.kv_bad when K rows [0, n) (D_k wide, from k_rows, ld_k apart) or V rows (D_v
// wide, from v_rows, ld_v apart) hold inf/NaN. v_first: V's first such row when the caller
// knows it (n or more: none), else -1 (V is read here).
template <typename A, typename T>
inline void screen_kv_rows(const Args<A>& a, const T* k_rows, i64 ld_k, const T* v_rows,
                           i64 ld_v, i64 n, i64 v_first = -1) {
  if (!a.kv_bad) return;
  const bool v_ok = v_first >= 0 ? v_first >= n : rows_finite(v_rows, ld_v, n, a.Dv);
  if (!v_ok || !rows_finite(k_rows, ld_k, n, a.Dk))
    a.kv_bad->store(true, std::memory_order_relaxed);
}

// One work item's rows and key range.
struct Item {
  i64 b, kvh, q0, nr;               // queries [q0, q0 + nr) of batch b, K/V head kvh
  i64 kb, ke;                       // keys this item may visit, [kb, ke)
};

// ------------------------------------------------------------------ masks in closed form
enum TileKind { EMPTY = 0, PARTIAL = 1, FULL = 2 };

// The keys any row of [q0, q0+nr) may see under band and lengths, within [lo_k, hi_k).
template <typename A>
inline void key_range(const Args<A>& a, Item& it, i64 lo_k, i64 hi_k) {
  double kb = double(lo_k), ke = double(hi_k);
  if (a.kv_len) ke = std::min(ke, double(a.kv_len[it.b * a.skl]));
  kb = std::max(kb, double(it.q0) - a.band_hi);                  // k >= q - hi
  ke = std::min(ke, double(it.q0 + it.nr - 1) - a.band_lo + 1);  // k <= q - lo
  it.kb = i64(std::max(kb, double(lo_k)));
  it.ke = i64(std::min(ke, double(hi_k)));
}

// Whether a row of n mask bytes (stride s) allows any / all keys: a contiguous row is read
// eight bytes to a word (a bool is 0 or 1), a broadcast one (s = 0) once.
inline void scan_row(const bool* m, i64 s, i64 n, bool& any, bool& all) {
  if (s == 0) {
    any = any || m[0];
    all = all && m[0];
    return;
  }
  i64 j = 0;
  if (s == 1) {
    constexpr uint64_t ONES = 0x0101010101010101ull;       // eight allowed keys
    uint64_t some = 0, every = ONES;
    for (; j + 8 <= n; j += 8) {                           // keys [j, j + 8)
      uint64_t w;
      std::memcpy(&w, m + j, 8);
      some |= w;
      every &= w;
    }
    any = any || some != 0;
    all = all && every == ONES;
  }
  for (; j < n; ++j) {
    any = any || m[j * s];
    all = all && m[j * s];
  }
}

// A dense mask's bytes over the item's rows (all G heads; one when the mask is broadcast
// over heads) x keys [k0, k0+n): any / all.
template <typename A>
inline TileKind scan_mask(const Args<A>& a, const Item& it, i64 k0, i64 n) {
  bool any = false, all = true;
  const i64 heads = a.sm[1] == 0 ? 1 : a.G;
  for (i64 g = 0; g < heads; ++g)
    for (i64 i = 0; i < it.nr; ++i) {
      const bool* mr = a.mask + it.b * a.sm[0] + (it.kvh * a.G + g) * a.sm[1] +
                       (it.q0 + i) * a.sm[2] + k0 * a.sm[3];
      scan_row(mr, a.sm[3], n, any, all);
      if (any && !all) return PARTIAL;
    }
  return any ? FULL : EMPTY;
}

// Whether tile [k0, k0+n) is empty, full or partial for the item's rows (all G heads).
template <typename A>
inline TileKind classify(const Args<A>& a, const Item& it, i64 k0, i64 n) {
  bool full = true;
  double dmin = double(it.q0 - (k0 + n - 1)), dmax = double(it.q0 + it.nr - 1 - k0);
  if (dmax < a.band_lo || dmin > a.band_hi) return EMPTY;
  if (!(dmin >= a.band_lo && dmax <= a.band_hi)) full = false;
  if (a.q_doc) {
    const i64* qd = a.q_doc + it.b * a.sqd[0];
    const i64* kd = a.k_doc + it.b * a.skd[0];
    i64 qmin = qd[it.q0 * a.sqd[1]], qmax = qmin, kmin = kd[k0 * a.skd[1]], kmax = kmin;
    for (i64 i = 0; i < it.nr; ++i) {
      i64 d = qd[(it.q0 + i) * a.sqd[1]];
      qmin = std::min(qmin, d); qmax = std::max(qmax, d);
    }
    for (i64 j = 0; j < n; ++j) {
      i64 d = kd[(k0 + j) * a.skd[1]];
      kmin = std::min(kmin, d); kmax = std::max(kmax, d);
    }
    if (qmax < kmin || kmax < qmin) return EMPTY;
    if (!(qmin == qmax && kmin == kmax && qmin == kmin)) full = false;
  }
  if (a.mask) {
    const TileKind m = scan_mask(a, it, k0, n);
    if (m == EMPTY) return EMPTY;
    if (m == PARTIAL) full = false;
  }
  return full ? FULL : PARTIAL;
}

// ------------------------------------------------------------------ a band's edge tiles
// A band's edge tile is a triangle: its keys are seen by fewer and fewer rows. Split into
// sub-blocks of SUB keys, each GEMM covers only the rows that see one of its keys.
constexpr int SUB = 32;

// Keys [k0 + j0, + n) of a tile, seen by rows [r0, r1) of each head of the item.
struct Sub { i64 j0, n, r0, r1; };

// The sub-blocks of tile [k0, k0 + n) and how many (one covering all rows when the tile is
// full, or when the band cuts none of its sub-blocks' rows).
template <typename A>
inline int tile_subs(const Args<A>& a, const Item& it, i64 k0, i64 n, TileKind kind,
                     Sub (&subs)[BK / SUB]) {
  if (kind != FULL) {
    int count = 0;
    bool cut = false;
    for (i64 j0 = 0; j0 < n; j0 += SUB) {                  // row q sees key c: lo <= q - c <= hi
      const i64 c0 = k0 + j0, c1 = std::min(k0 + n, c0 + SUB);
      const double lo = std::ceil(double(c0) + a.band_lo) - double(it.q0);
      const double hi = std::floor(double(c1 - 1) + a.band_hi) - double(it.q0) + 1.0;
      const i64 r0 = i64(std::clamp(lo, 0.0, double(it.nr)));
      const i64 r1 = std::max(r0, i64(std::clamp(hi, 0.0, double(it.nr))));
      cut = cut || r0 > 0 || r1 < it.nr;
      subs[count++] = Sub{j0, c1 - c0, r0, r1};
    }
    if (cut) return count;
  }
  subs[0] = Sub{0, n, 0, it.nr};
  return 1;
}

// Calls f(row0, rows, j0, nj) for each GEMM a tile's sub-blocks make: one over all G * nr
// rows when there is one sub-block (it covers every row), else one per (sub-block, head).
template <typename F>
inline void for_each_block(const Sub* subs, int count, i64 G, i64 nr, F f) {
  if (count == 1) return f(0, G * nr, 0, subs[0].n);
  for (int s = 0; s < count; ++s)
    for (i64 g = 0; g < G; ++g)
      if (subs[s].r1 > subs[s].r0) f(g * nr + subs[s].r0, subs[s].r1 - subs[s].r0, subs[s].j0,
                                     subs[s].n);
}

// The zero scores of the rows a sub-block skips (they are out of the band, masked later);
// scores (G * nr, ld).
template <typename A>
inline void zero_skipped(const Sub* subs, int count, i64 G, i64 nr, A* scores, i64 ld = BK) {
  for (int s = 0; s < count; ++s)
    for (i64 g = 0; g < G; ++g)
      for (i64 i = 0; i < nr; ++i)
        if (i < subs[s].r0 || i >= subs[s].r1)
          std::fill_n(scores + (g * nr + i) * ld + subs[s].j0, subs[s].n, A(0));
}

// ------------------------------------------------------------------ the fused row pass
// One soft-cap loop: x (npad,) <- c * tanh(y(x)), and with Fac also fac <- scale * (1 -
// tanh^2) (the backward's d(capped)/d(score)). Small: |y| < 0.625 on the whole row, so the
// odd polynomial alone (no e^x, no division). A loop of its own per form, so that none tests
// the form per vector.
template <bool Small, bool Fac, typename A, typename Y>
inline void cap_row(A* x, i64 npad, A* fac, A scale, A cap, Y y_of) {
  using V = vec<A>;
  const V sc = splat(scale), c = splat(cap);
  for (i64 j = 0; j < npad; j += lanes<A>) {               // keys [j, j + L)
    const V y = y_of(load(x + j));
    const V t = Small ? vtanh_small(y) : vtanh(y);
    store(x + j, c * t);
    if constexpr (Fac) store(fac + j, sc - sc * t * t);
  }
}
template <bool Small, typename A, typename Y>
inline void cap_row(A* x, i64 npad, A* fac, A scale, A cap, Y y_of) {
  if (fac) cap_row<Small, true>(x, npad, fac, scale, cap, y_of);
  else cap_row<Small, false>(x, npad, fac, scale, cap, y_of);
}

// x (npad,) <- x * scale, soft-capped: c * tanh(x * scale / c). With fac, also the
// derivative d(capped)/d(score) per key, scale * (1 - tanh^2) (the backward's chain rule).
// scale may be negative (c > 0 always): the small-argument test uses |scale / c|. When
// scale / c overflows A (e.g. 1e20 / 1e-20 in float), x * (scale / c) would be 0 * inf = NaN
// for a zero score: then y = (x * scale) / c (a division per lane, on this rare path only),
// which is 0 for x = 0 and ±inf (tanh ±1) otherwise, as the reference's x * scale / c.
template <typename A> inline void scale_and_cap(const Args<A>& a, A* x, i64 npad, A* fac) {
  using V = vec<A>;
  constexpr int L = lanes<A>;
  const V sc = splat(a.scale);
  if (!(a.softcap > A(0))) {
    for (i64 j = 0; j < npad; j += L) store(x + j, load(x + j) * sc);
    if (fac)
      for (i64 j = 0; j < npad; j += L) store(fac + j, sc);
    return;
  }
  const A c = a.softcap, r = a.scale / c;                  // x * r = x * scale / c
  if (!std::isfinite(r))
    return cap_row<false>(x, npad, fac, a.scale, c, [&](V v) { return (v * sc) / splat(c); });
  V a0 = splat(A(0)), a1 = a0;                   // a row whose |x * scale / c| < 0.625
  i64 j = 0;                                      // (the usual case); two chains of maxima
  for (; j + 2 * L <= npad; j += 2 * L) {                   // keys [j, j + 2L)
    a0 = vmax(a0, vabs(load(x + j)));
    a1 = vmax(a1, vabs(load(x + j + L)));
  }
  if (j < npad) a0 = vmax(a0, vabs(load(x + j)));
  const V vr = splat(r);
  const auto y_of = [vr](V v) { return v * vr; };
  if (hmax(vmax(a0, a1)) * std::abs(r) < A(0.625))
    cap_row<true>(x, npad, fac, a.scale, c, y_of);
  else
    cap_row<false>(x, npad, fac, a.scale, c, y_of);
}

// The relative-position buckets of row qi over keys [k0, k0+n): keys [0, jl) have
// k - qi <= -M (bucket 0), keys [jh, n) have k - qi >= M (bucket 2M), and key j in [jl, jh)
// has bucket k0 + j - qi + M (contiguous). M = 0: every key is bucket 0.
inline void rel_segments(i64 M, i64 n, i64 qi, i64 k0, i64& jl, i64& jh) {
  jl = std::clamp<i64>(qi - M - k0 + 1, 0, n);
  jh = std::max(jl, std::clamp<i64>(qi + M - k0, 0, n));
}

// x[j] += table[h, clamp(k0 + j - qi, -M, M) + M] for j in [0, n) (scores.relative_bias).
template <typename A>
inline void relative_bias_add(const Args<A>& a, A* x, i64 n, i64 h, i64 qi, i64 k0) {
  const i64 M = a.rel_M;
  const A* t = a.rel + h * (2 * M + 1);                    // (2M+1,) this head's row
  i64 jl, jh;
  rel_segments(M, n, qi, k0, jl, jh);
  const A t_lo = t[0], t_hi = t[2 * M];
  const i64 off = k0 - qi + M;                             // bucket of key j = off + j
  for (i64 j = 0; j < jl; ++j) x[j] += t_lo;
  for (i64 j = jl; j < jh; ++j) x[j] += t[off + j];
  for (i64 j = jh; j < n; ++j) x[j] += t_hi;
}

// The band's keys of row qi within the tile [k0, k0+n): [jb, je), the row's allowed keys
// being [qi - hi, qi - lo] (bounds need not be whole: ceil and floor them).
template <typename A>
inline void band_keys(const Args<A>& a, i64 n, i64 qi, i64 k0, i64& jb, i64& je) {
  const double lo_k = double(qi) - a.band_hi - double(k0);
  const double hi_k = double(qi) - a.band_lo - double(k0);
  jb = i64(std::clamp(std::ceil(lo_k), 0.0, double(n)));
  je = std::max(jb, i64(std::clamp(std::floor(hi_k) + 1.0, 0.0, double(n))));
}

// x[j] = -inf where a dense mask's row m (n bools, stride s) is false. A contiguous row is
// read L bytes at a time into a lane mask (a byte per key; no branch per key: random masks
// mispredicted half the time), a broadcast one (s = 0) once.
typedef uint8_t vbf __attribute__((vector_size(W)));        // L = W bytes, for float lanes
typedef uint8_t vbd __attribute__((vector_size(W / 2)));    // W / 2 bytes, for double lanes
template <typename A> struct MaskLanes;                    // the comparison mask of vec<A>
template <> struct MaskLanes<float> { using M = vi; using Bytes = vbf; };
template <> struct MaskLanes<double> { using M = vl; using Bytes = vbd; };
template <typename A> inline typename MaskLanes<A>::M lane_mask(const bool* m) {
  using M = typename MaskLanes<A>::M;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<A, float>) {                // 16 bytes -> 16 int32 lanes
    const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)m));
    return (M)w != 0;
  }
#elif defined(__AVX2__)
  if constexpr (std::is_same_v<A, float>) {                // 8 bytes -> 8 int32 lanes
    const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)m));
    return (M)w != 0;
  }
#endif
  typename MaskLanes<A>::Bytes bytes;                     // one byte (0 / 1) per lane
  std::memcpy(&bytes, m, sizeof bytes);
  return __builtin_convertvector(bytes, M) != 0;          // -1 = allowed
}
template <typename A> inline void mask_row(const bool* m, i64 s, A* x, i64 n) {
  constexpr int L = lanes<A>;
  if (s == 0) {
    if (!m[0]) std::fill(x, x + n, A(NEG_INF));
    return;
  }
  i64 j = 0;
  if (s == 1) {
    const vec<A> ninf = splat(A(NEG_INF));
    for (; j + L <= n; j += L)                             // keys [j, j + L)
      store(x + j, select(lane_mask<A>(m + j), load(x + j), ninf));
  }
  for (; j < n; ++j) x[j] = m[j * s] ? x[j] : A(NEG_INF);
}

// x (npad,) of row (head h, query qi) against keys [k0, k0+n): ALiBi, the relative bias
// table, bias, then the mask (skipped on FULL tiles); x[n:npad] = -inf. x in units of unit
// (the low-precision row pass's raw scores: unit = scale; ALiBi's slope divided by it).
template <typename A>
inline void position_terms_and_mask(const Args<A>& a, A* x, i64 n, i64 npad, i64 b, i64 h,
                                    i64 qi, i64 k0, bool full, A unit = A(1)) {
  using V = vec<A>;
  if (a.alibi) {                                    // x -= slope * |qi + off - (k0 + j)|
    const V slope = splat(unit == A(1) ? a.alibi[h] : a.alibi[h] / unit);  // (x in units)
    V d = splat(A(qi - k0) + a.alibi_offset) - iota<A>();  // signed distances of keys [0, L)
    for (i64 j = 0; j < npad; j += lanes<A>, d -= A(lanes<A>))  // (whole numbers: exact)
      store(x + j, load(x + j) - slope * vabs(d));
  }
  if (a.rel) relative_bias_add(a, x, n, h, qi, k0);
  if (a.bias) {
    const A* br = a.bias + b * a.sb[0] + h * a.sb[1] + qi * a.sb[2] + k0 * a.sb[3];
    const i64 s = a.sb[3];
    if (s == 1) {
      for (i64 j = 0; j < n; ++j) x[j] += br[j];               // (vectorised)
    } else {
      for (i64 j = 0; j < n; ++j) x[j] += br[j * s];
    }
  }
  if (!full) {
    i64 jb, je;
    band_keys(a, n, qi, k0, jb, je);
    for (i64 j = 0; j < jb; ++j) x[j] = NEG_INF;
    for (i64 j = je; j < n; ++j) x[j] = NEG_INF;
    if (a.q_doc) {
      const i64 qd = a.q_doc[b * a.sqd[0] + qi * a.sqd[1]];
      const i64* kd = a.k_doc + b * a.skd[0] + k0 * a.skd[1];
      for (i64 j = 0; j < n; ++j) x[j] = kd[j * a.skd[1]] == qd ? x[j] : NEG_INF;
    }
    if (a.mask)
      mask_row(a.mask + b * a.sm[0] + h * a.sm[1] + qi * a.sm[2] + k0 * a.sm[3], a.sm[3], x, n);
  }
  for (i64 j = n; j < npad; ++j) x[j] = NEG_INF;
}

// Whether position_terms_and_mask has anything to do on a tile: a mask (not FULL), padding
// lanes (n < npad) or a position term.
template <typename A> inline bool has_position_terms(const Args<A>& a, i64 n, i64 npad, bool full) {
  return !full || n != npad || a.alibi || a.rel || a.bias;
}

// Whether the score_mod takes the raw scores and the scale (apply_score_mod's scale): no
// soft-cap between them.
template <typename A> inline bool mod_takes_scale(const Args<A>& a) {
  return a.mod && !(a.softcap > A(0));
}

// The whole fused pass on one row of scores: scale, softcap, score_mod (or ALiBi, relative
// bias), bias, mask.
template <typename A>
inline void score_terms(const Args<A>& a, A* x, i64 n, i64 npad, i64 b, i64 h, i64 qi, i64 k0,
                        bool full) {
  if (mod_takes_scale(a)) {
    apply_score_mod(a, x, nullptr, n, b, h, qi, k0, double(a.scale));
  } else {
    scale_and_cap(a, x, npad, static_cast<A*>(nullptr));
    apply_score_mod(a, x, nullptr, n, b, h, qi, k0);
  }
  if (has_position_terms(a, n, npad, full)) position_terms_and_mask(a, x, n, npad, b, h, qi, k0, full);
}

// Online softmax step on one row: x (npad,) -> P = e^(x - m_new) in place; updates the
// running max m and sum l; returns alpha = e^(m_old - m_new), the factor for acc. (The
// low-precision path has its own: rows_pass_lowp, forward.h, with row_max_lowp /
// row_exp_lowp, lowp.h.)
// (Scaling and taking the max in one pass measured no faster: the row is in L1.)
template <typename A> inline A softmax_step(A* x, i64 npad, A& m, A& l) {
  using V = vec<A>;
  constexpr int L = lanes<A>;
  V vm = splat(A(NEG_INF));
  for (i64 j = 0; j < npad; j += L) {
    V v = load(x + j);
    vm = v > vm ? v : vm;
  }
  const A m_new = std::max(m, hmax(vm));
  const A shift = m_new == NEG_INF ? A(0) : m_new;        // a row with no key yet: P = 0
  const V vs = splat(shift);
  V sum = splat(A(0));
  for (i64 j = 0; j < npad; j += L) {
    V p = vexp_neg(load(x + j) - vs);
    store(x + j, p);
    sum += p;
  }
  const A alpha = m == NEG_INF ? A(0) : std::exp(m - shift);
  l = l * alpha + hsum(sum);
  m = m_new;
  return alpha;
}

}  // namespace
}  // namespace attnkit_native
