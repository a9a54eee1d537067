// The forward's low-precision GEMMs: bfloat16 / float16 inputs multiplied in their own dtype
// (fp32 accumulation) through torch's brgemm (oneDNN: AMX tiles where the CPU has them,
// AVX512-BF16 dot products elsewhere), with B packed in the VNNI layout.
//
//   VNNI block of a (K, 64) matrix B:  (K / 2, 64, 2)   element (k, n) at [k / 2][n][k % 2]
//   Kᵀ tile (DKE, BK)  -> one VNNI block BK wide, (DKE / 2, BK, 2)    (DKE = D_k rounded to 2)
//   V tile  (BK, D_v)  -> DVB / 64 such blocks (BK / 2, 64, 2)        (DVB = D_v rounded to 64)
//                         in planes of 64 columns holding every tile's rows (LowpBuffers)
//   Q rows  (R, DKE) and P (R, SPAN * BK) in T; S (R, SPAN * BK) and acc (R, DVP) float.
//
// Which path a call takes is decided at run time (lowp_path): the environment switch
// ATTNKIT_NATIVE_LOWP_GEMM=0 forces the widening path (T -> float, float GEMMs); a CPU or
// build whose brgemm has no kernel for T (no AVX512-BF16 / AMX for bfloat16; no AVX512-FP16
// / AMX-FP16 for float16), or whose packing fails a numerical self-test, widens too.
// ATTNKIT_NATIVE_LOWP_GEMM=emulate runs this path with a plain C++ product of the same
// packed operands in place of brgemm (emulated_brgemm: slow, for tests), so that the path's
// packing, rounding and sub-blocks are tested on every CPU.
#pragma once
#include <ATen/Context.h>
#include <ATen/cpu/Utils.h>

#include <array>
#include <cstdlib>
#include <string>

#include "common.h"

namespace attnkit_native {
namespace {

constexpr int NB = 64;  // columns per VNNI block (oneDNN's pack: ld_out in 16, 32, 48, 64)

template <typename T> constexpr bool is_lowp = std::is_same_v<T, at::BFloat16> ||
                                               std::is_same_v<T, at::Half>;

// ------------------------------------------------------------------ packing
// dst (K / 2, N, 2) <- src (K, N) row-major, K even: our own interleave (any N), or oneDNN's
// pack where it has one for T (AMX; N = NB only). Both give the layout brgemm reads with
// is_vnni = true; the self-test in probe() checks that on the machine it runs on.
template <typename T>
inline void vnni_pack(i64 K, i64 N, const T* src, T* dst, bool onednn_pack) {
  if (onednn_pack && N == NB) {
    at::native::cpublas::pack(K, NB, NB, NB, c10::CppTypeToScalarType<T>::value,
                              c10::CppTypeToScalarType<T>::value, src, dst);
    return;
  }
  for (i64 p = 0; p < K / 2; ++p)                         // pair of rows 2p, 2p + 1 (N,)
    for (i64 n = 0; n < N; ++n) {
      dst[(p * N + n) * 2] = src[2 * p * N + n];
      dst[(p * N + n) * 2 + 1] = src[(2 * p + 1) * N + n];
    }
}

// ------------------------------------------------------------------ which path runs
struct LowpPath {
  bool gemm;                // T GEMMs available (and correct) on this CPU
  bool onednn_pack;         // pack with oneDNN (AMX) rather than our own interleave
  std::string why;          // said by lowp_path() and attnkit's info
  bool emulate = false;     // the GEMMs by emulated_brgemm (ATTNKIT_NATIVE_LOWP_GEMM=emulate)
};

// Whether brgemm on an (M, 8) x (8, n) product, B rows [k0, k0 + 8) and columns
// [off, off + n) of a packed (16, N) block (as the kernel's sub-blocks address V, N = NB, and
// Kᵀ, N = BK), gives the exact product (small integers: exact in T and in float). Throws
// where brgemm has no T kernel.
template <typename T>
bool probe_product(i64 M, i64 N, i64 n, i64 k0, i64 off, bool onednn_pack) {
  constexpr i64 K = 8, KB = 16;
  T a[16 * K], b[KB * BK], bp[KB * BK];
  float c[16 * BK];
  for (i64 i = 0; i < M * K; ++i) a[i] = T(float(i % 7 - 3));
  for (i64 i = 0; i < KB * N; ++i) b[i] = T(float(i % 5 - 2));
  vnni_pack(KB, N, b, bp, onednn_pack);
  at::native::cpublas::brgemm(M, n, K, K, N, N, false, a, bp + k0 * N + off * 2, c, true);
  at::native::cpublas::brgemm_release(true);
  for (i64 i = 0; i < M; ++i)
    for (i64 j = 0; j < n; ++j) {
      float want = 0.f;
      for (i64 p = 0; p < K; ++p) want += float(a[i * K + p]) * float(b[(k0 + p) * N + off + j]);
      if (c[i * N + j] != want) return false;
    }
  return true;
}

// Whether brgemm gives exact products on both packed layouts: V's (a whole block; a tail of
// rows and columns from row 8, column 32) and Kᵀ's (the same in a block BK wide, the tail
// from column 96); with onednn_pack, V's packed by oneDNN.
template <typename T> bool probe_layouts(bool onednn_pack) {
  return probe_product<T>(16, NB, NB, 0, 0, onednn_pack) &&
         probe_product<T>(5, NB, 29, 8, 32, onednn_pack) &&
         probe_product<T>(16, BK, BK, 0, 0, onednn_pack) &&
         probe_product<T>(5, BK, 29, 8, 96, onednn_pack);
}

// Whether brgemm reads B row-major (K, NB), unpacked, instead: oneDNN's float16 kernels on
// AVX512-FP16 without AMX-FP16 do (no VNNI there), which this path does not pack for.
template <typename T> bool probe_unpacked() {
  constexpr i64 M = 16, K = 8;
  T a[M * K], b[K * NB];
  float c[M * NB];
  for (i64 i = 0; i < M * K; ++i) a[i] = T(float(i % 7 - 3));
  for (i64 i = 0; i < K * NB; ++i) b[i] = T(float(i % 5 - 2));
  at::native::cpublas::brgemm(M, NB, K, K, NB, NB, false, a, b, c, true);
  at::native::cpublas::brgemm_release(true);
  for (i64 i = 0; i < M; ++i)
    for (i64 j = 0; j < NB; ++j) {
      float want = 0.f;
      for (i64 p = 0; p < K; ++p) want += float(a[i * K + p]) * float(b[p * NB + j]);
      if (c[i * NB + j] != want) return false;
    }
  return true;
}

// Whether T GEMMs run here (probe_layouts), and why not.
template <typename T> LowpPath probe() {
  const std::string name = std::is_same_v<T, at::BFloat16> ? "bfloat16" : "float16";
  const bool amx = at::cpu::init_amx();                  // tile permission from the OS, if any
  const bool onednn_pack = at::native::cpublas::could_pack(c10::CppTypeToScalarType<T>::value);
  bool ok;
  try {
    ok = probe_layouts<T>(onednn_pack);
  } catch (const std::exception&) {
    return {false, false, "widening to float32: torch's brgemm has no " + name +
                              " kernel on this CPU (oneDNN needs " +
                              (std::is_same_v<T, at::BFloat16> ? "AVX512-BF16 or AMX"
                                                               : "AVX512-FP16 or AMX-FP16") +
                              ")"};
  }
  if (!ok && probe_unpacked<T>())
    return {false, false, "widening to float32: torch's " + name + " brgemm on this CPU reads B "
                              "row-major, not in the VNNI layout this path packs (oneDNN's "
                              "AVX512-FP16 kernels, where there is no AMX-FP16)"};
  if (!ok)
    return {false, false, "widening to float32: the " + name +
                              " brgemm self-test failed (packed layout not as expected)"};
  return {true, onednn_pack,
          name + " GEMMs (oneDNN brgemm, fp32 accumulation, B in VNNI layout: " +
              (onednn_pack ? "V packed by oneDNN, Kᵀ by attnkit" : "packed by attnkit") +
              (amx ? ", AMX tiles" : ", no AMX: oneDNN's AVX512 kernels") + ")"};
}

template <typename T> const LowpPath& probed() {
  static const LowpPath p = probe<T>();                  // once per process and dtype
  return p;
}

// What ATTNKIT_NATIVE_LOWP_GEMM asks (read at every call): the default, widening, emulation.
enum class LowpSwitch { DEFAULT, OFF, EMULATE };
inline LowpSwitch lowp_switch() {
  const char* e = std::getenv("ATTNKIT_NATIVE_LOWP_GEMM");
  if (!e) return LowpSwitch::DEFAULT;
  const std::string s(e);
  if (s == "0" || s == "false" || s == "off" || s == "no") return LowpSwitch::OFF;
  return s == "emulate" ? LowpSwitch::EMULATE : LowpSwitch::DEFAULT;
}

// The path a call with T inputs takes now, and why.
template <typename T> LowpPath lowp_path() {
  if constexpr (!is_lowp<T>) {
    return {false, false, "not a low-precision dtype"};
  } else {
    const LowpSwitch sw = lowp_switch();
    if (sw == LowpSwitch::OFF)
      return {false, false, "widening to float32: ATTNKIT_NATIVE_LOWP_GEMM=0"};
    if (sw == LowpSwitch::EMULATE)
      return {true, false, std::string(std::is_same_v<T, at::BFloat16> ? "bfloat16" : "float16") +
                               " GEMMs emulated in plain C++ (ATTNKIT_NATIVE_LOWP_GEMM=emulate: "
                               "the path's test mode, slow)", true};
    if (!at::globalContext().userEnabledMkldnn())
      return {false, false, "widening to float32: torch.backends.mkldnn is disabled"};
    return probed<T>();
  }
}

// ------------------------------------------------------------------ conversions
// dst[0 : W] = bfloat16(x), rounded to nearest even (NaN stays NaN), in plain vector code.
inline void store_rounded_generic(at::BFloat16* dst, vf x) {
  typedef uint32_t vu __attribute__((vector_size(W * 4)));
  typedef uint16_t vh __attribute__((vector_size(W * 2)));
  vu u;
  std::memcpy(&u, &x, sizeof u);
  vu r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;          // bfloat16 = a float's top half
  r = select(x != x, vu{} + 0x7FC0u, r);
  const vh h = __builtin_convertvector(r, vh);
  std::memcpy(dst, &h, sizeof h);
}
// dst[0 : W] = T(x), rounded to nearest even (NaN stays NaN). bfloat16 where the build has
// AVX512-BF16 (the loader's avx512bf16 level): one vcvtneps2bf16, which also flushes float32
// denormals (below 1.2e-38) to 0; elsewhere the generic rounding above.
inline void store_rounded(at::BFloat16* dst, vf x) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh((__m512)x));
#else
  store_rounded_generic(dst, x);
#endif
}
// float: x as it is (the float32 forward's row pass is rows_pass_lowp with T = float).
inline void store_rounded(float* dst, vf x) { store(dst, x); }
inline void store_rounded(at::Half* dst, vf x) {
#if defined(__F16C__) && defined(__AVX512F__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm512_cvtps_ph((__m512)x, _MM_FROUND_TO_NEAREST_INT));
#elif defined(__F16C__) && (defined(__AVX2__) || defined(__AVX__))
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                   _mm256_cvtps_ph((__m256)x, _MM_FROUND_TO_NEAREST_INT));
#else
  for (int i = 0; i < W; ++i) dst[i] = at::Half(x[i]);
#endif
}

// ------------------------------------------------------------------ the softmax step
// 2^f for |f| <= 1/2 to ~2e-7 relative: a degree-5 polynomial fitted for relative error.
inline vf exp2_reduced(vf f) {
  vf y = splat(1.3264692388e-3f);
  y = y * f + 9.6715148538e-3f;
  y = y * f + 5.5507339537e-2f;
  y = y * f + 2.4022242427e-1f;
  y = y * f + 6.9314700365e-1f;
  return y * f + 1.f;
}

// 2^t for t <= 0 to ~2e-7 relative (P is rounded to T, 2^-9, right after): t = n + f with n
// whole, |f| <= 1/2. With AVX-512, n by vrndscaleps and 2^n applied by vscalefps, which
// zeroes the lanes below t = -125 (e^-86.6) itself (its masked form): a result there would be
// a denormal, and denormal results cost a microcode assist each — a sliding window's masked
// keys (-inf) ran 1.8x slower through an underflowing vscalefps. Those lanes need no clamp
// (whatever they compute, -inf - -inf = NaN included, is zeroed; NaN and inf cost no assist).
// Elsewhere n is read from t + 1.5 * 2^23's low bits and put in the exponent bits (t clamped
// at -127, whose bits are 0). -inf (a masked key) gives exactly 0; NaN stays NaN.
inline vf exp2_neg(vf t) {
#if defined(__AVX512F__)
  const __mmask16 live = _mm512_cmp_ps_mask((__m512)t, _mm512_set1_ps(-125.f), _CMP_NLT_UQ);
  const __m512 n = _mm512_roundscale_ps((__m512)t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return (vf)_mm512_maskz_scalef_ps(live, (__m512)exp2_reduced(t - (vf)n), n);
#else
  const vf magic = splat(12582912.f);
  t = select(t < -127.f, splat(-127.f), t);
  const vf k = t + magic;                                 // round(t) in the low bits
  return exp2_reduced(t - (k - magic)) * (vf)(((vi)k + 127) << 23);
#endif
}

// 2^t for -125 <= t <= 0 (or NaN): exp2_neg without its underflow mask, which no lane
// needs there (a soft-capped row's exponents: t >= -2 c log2e).
inline vf exp2_bounded(vf t) {
#if defined(__AVX512F__)
  const __m512 n = _mm512_roundscale_ps((__m512)t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return (vf)_mm512_scalef_ps((__m512)exp2_reduced(t - (vf)n), n);
#else
  return exp2_neg(t);
#endif
}
template <bool Bounded> inline vf exp2_of(vf t) { return Bounded ? exp2_bounded(t) : exp2_neg(t); }

// dst[0 : 2W] = T(lo), T(hi): bfloat16 by one vcvtne2ps2bf16 where the build has it.
inline void store_rounded2(at::BFloat16* dst, vf lo, vf hi) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh((__m512)hi, (__m512)lo));
#else
  store_rounded(dst, lo);
  store_rounded(dst + W, hi);
#endif
}
inline void store_rounded2(at::Half* dst, vf lo, vf hi) {
  store_rounded(dst, lo);
  store_rounded(dst + W, hi);
}
inline void store_rounded2(float* dst, vf lo, vf hi) {    // float: as they are
  store(dst, lo);
  store(dst + W, hi);
}

// v as it is, opaque to the compiler: a product passed through it is rounded before the
// next operation (no fused multiply-add across it).
inline vf rounded(vf v) {
#if defined(__AVX512F__)
  asm("" : "+v"(v));
#else
  asm("" : "+x"(v));
#endif
  return v;
}

// The low-precision path's online softmax step, in two passes over a tile's rows so that
// rows overlap in the core (one row's max -> exponentials -> sum is a long serial chain).
// x (npad,) holds a row's scores s in units of c (c = scale when the max and the exponent
// take the raw scores, else 1; c > 0); m (scaled units) and l are its running max and sum.
// The first pass: the row's largest s (NaN lanes skipped: vmax; -inf if none).
inline float row_max_lowp(const float* x, i64 npad) {
  vf m0 = splat(NEG_INF), m1 = m0;                        // two chains of maxima
  i64 j = 0;
  for (; j + 2 * W <= npad; j += 2 * W) {                 // keys [j, j + 2W)
    m0 = vmax(m0, load(x + j));
    m1 = vmax(m1, load(x + j + W));
  }
  if (j < npad) m0 = vmax(m0, load(x + j));
  return hmax(vmax(m0, m1));
}

// P = 2^(e(x) - shift) for keys [0, n) of a row (n a multiple of W), e(v) a vector of
// exponents in log2 units (rounded): P rounded to T into p (with Keep also as float in x);
// returns the lane sums of P. Bounded: every e(x) - shift is >= -125 or NaN (exp2_bounded).
template <bool Keep, bool Bounded = false, typename T, typename E>
__attribute__((always_inline)) inline vf exp_keys(float* x, i64 n, vf vs, T* p, E e) {
  vf s0 = splat(0.f), s1 = s0;                            // two chains of sums
  i64 j = 0;
  for (; j + 2 * W <= n; j += 2 * W) {                    // keys [j, j + 2W)
    const vf p0 = exp2_of<Bounded>(e(load(x + j)) - vs);
    const vf p1 = exp2_of<Bounded>(e(load(x + j + W)) - vs);
    if constexpr (Keep) {
      store(x + j, p0);
      store(x + j + W, p1);
    }
    store_rounded2(p + j, p0, p1);
    s0 += p0;
    s1 += p1;
  }
  if (j < n) {                                            // keys [j, j + W)
    const vf pj = exp2_of<Bounded>(e(load(x + j)) - vs);
    if constexpr (Keep) store(x + j, pj);
    store_rounded(p + j, pj);
    s0 += pj;
  }
  return s0 + s1;
}

// The online softmax's bookkeeping for a row whose largest logit this step is top (natural
// units; -inf: no key), top2 its exponent in log2 units as the row's exponent pass computes it:
// returns the shift that pass subtracts — top2 where this step holds the new max (so that its
// key gets 2^0 = 1 exactly, every exponent's error being that of its own product, as when
// scores are scaled first: one FMA against a shift rounded apart leaves ~|m| 2^-23 in every
// exponent, at a score of 1e30 2^(1e22)), 0 for a row with no key yet (P = 0) — and sets
// m_new = max(m, top).
inline float exp_shift(float top, float top2, float m, float& m_new) {
  constexpr float LOG2E = 1.44269504088896341f;
  m_new = std::max(m, top);
  return m_new == NEG_INF ? 0.f : top >= m ? top2 : m_new * LOG2E;
}

// After a row's exponent pass (lane sums sum of its P): l and m updated; returns alpha =
// e^(m - m_new), acc's factor.
inline float exp_finish(vf sum, float m_new, float& m, float& l) {
  constexpr float LOG2E = 1.44269504088896341f;
  const float alpha = m == NEG_INF ? 0.f : exp2_neg(splat((m - m_new) * LOG2E))[0];
  l = l * alpha + hsum(sum);
  m = m_new;
  return alpha;
}

// The second, given the row's largest s, top: P = e^(c s - m_new) rounded to T into p (with
// Keep also as float in x: the exact values path reads it); l and m updated; returns alpha
// = e^(m - m_new), acc's factor. The exponent is round(s * c log2e) - shift, shift rounded
// the same way from the same s where this tile holds the new max (exp_shift).
// (always inlined: rows_pass_lowp called it out of line once it asked for rows ahead)
template <bool Keep, typename T>
__attribute__((always_inline)) inline float row_exp_lowp(float* x, i64 npad, float c, float top,
                                                         float& m, float& l, T* p) {
  constexpr float LOG2E = 1.44269504088896341f;
  const float cl = c * LOG2E;
  float m_new;
  const vf vc = splat(cl), vs = splat(exp_shift(top * c, top * cl, m, m_new));
  const vf sum = exp_keys<Keep>(x, npad, vs, p, [vc](vf v) { return rounded(v * vc); });
  return exp_finish(sum, m_new, m, l);
}

// The soft-capped logit c tanh(s r) of raw scores s (r = scale / c > 0; c tanh(s scale / c)
// of the scaled score) in log2 units, as the exponent pass takes it (round(... log2e): no
// separate pass scales and caps the row). K > 0: |s r| below cap_form(K)'s bound over the
// rows, so tanh's odd polynomial alone, tanh y = y + y z P(z) (z = y^2), written as
// u + u (z P(z)) with u = s scale log2e (c tanh(y) log2e = u (1 + z P(z))): P of degree 4
// (K = 5: vtanh_small's, Cephes' minimax below 0.625) or the Taylor series' first K terms
// (whose next term, the error, stays below 2^-25 of tanh there). K = 0: vtanh (e^x, a
// division) times c log2e. natural(): the same logit in natural units.
template <int K> struct CapExponent {
  vf r, k, cl, c;                                         // r; scale log2e; c log2e; c
  CapExponent(float scale, float cap) {
    constexpr float LOG2E = 1.44269504088896341f;
    r = splat(scale / cap);
    k = splat(scale * LOG2E);
    cl = splat(cap * LOG2E);
    c = splat(cap);
  }
  static vf zp(vf y) {                                    // z P(z), z = y^2
    const vf z = y * y;
    vf p;
    if constexpr (K == 5) {
      p = splat(-5.70498872745e-3f);
      p = p * z + 2.06390887954e-2f;
      p = p * z - 5.37397155531e-2f;
      p = p * z + 1.33314422036e-1f;
      p = p * z - 3.33332819422e-1f;
    } else {                                              // K = 3: -1/3 + 2/15 z - 17/315 z^2
      static_assert(K == 3);
      p = splat(-17.f / 315.f);
      p = p * z + 2.f / 15.f;
      p = p * z - 1.f / 3.f;
    }
    return p * z;
  }
  vf operator()(vf s) const {
    if constexpr (K > 0) {
      const vf u = s * k;
      return rounded(u * zp(s * r) + u);
    } else {
      return rounded(cl * vtanh(s * r));
    }
  }
};

// CapExponent<3> with its powers of r folded into the coefficients: u + (s w) Q(w), w = s^2,
// Q(w) = k r^2 (-1/3 + 2/15 r^2 w - 17/315 r^4 w^2) (one product fewer per lane). fits(r):
// every coefficient a normal float and, for |s r| < 0.18, s w finite (r in [1e-6, 1e6]).
struct CapTaylor3 {
  vf k, q0, q1, q2;
  CapTaylor3(float scale, float cap) {
    constexpr double LOG2E = 1.44269504088896341;
    const double r2 = double(scale / cap) * double(scale / cap), kd = double(scale) * LOG2E;
    k = splat(float(kd));
    q0 = splat(float(-kd * r2 / 3));
    q1 = splat(float(kd * r2 * r2 * 2 / 15));
    q2 = splat(float(-kd * r2 * r2 * r2 * 17 / 315));
  }
  static bool fits(float scale, float cap) {
    const float r = scale / cap;
    if (!(r >= 1e-6f && r <= 1e6f)) return false;
    const CapTaylor3 f(scale, cap);
    return std::isnormal(f.q0[0]) && std::isnormal(f.q1[0]) && std::isnormal(f.q2[0]);
  }
  vf operator()(vf s) const {
    const vf w = s * s;
    vf q = q2 * w + q1;
    q = q * w + q0;
    return rounded((s * w) * q + s * k);
  }
};

// The form CapExponent takes for rows whose largest |s r| is y: the Taylor series' first
// three terms below 0.18 (the fourth, 62/2835 y^8, < 2^-25), vtanh_small's polynomial below
// 0.625, else 0 (vtanh). inf / NaN: 0.
inline int cap_form(float y) { return y < 0.18f ? 3 : y < 0.625f ? 5 : 0; }

// ------------------------------------------------------------------ per-thread buffers
// Key tiles taken together by the forward's low-precision loop (a span: their scores side
// by side, one row pass, one P . V product over all their keys where none is cut into
// sub-blocks). On AMX, P . V over 256 keys ran ~1.2x the rate of two 128-key products.
constexpr int SPAN = 2;

// The packed Kᵀ and V of one head (NKP / BK tiles, filled as items need them) or of a
// span's SPAN tiles, the item's Q rows, S (R, SPAN * BK) and P (R, SPAN * BK) of a span, and a staging
// block for the packing. V is kept by planes of NB columns, each plane all the tiles' keys:
// block c (columns [c, c + NB)) of tile t at v_at(t) + c * vps, so that consecutive tiles'
// rows are consecutive in each plane (one brgemm reads a span's V).
template <typename T> struct LowpBuffers {
  i64 DKE, DVB, kt_tile, vps;                             // Kᵀ tile size; V plane stride / NB
  AlignedArray<T> q, p, kt, v, stage;
  AlignedArray<float> s, mx;                             // S of a span; (R,) rows' largest s
  std::vector<char> done;                                 // (tiles,) packed yet
  std::vector<i64> v_bad;                                 // (tiles,) first non-finite V row
  i64 cb = -1, ch = -1;                                   // the cached head
  bool cache, onednn_pack;
  template <typename A> LowpBuffers(const Args<A>& a, i64 R)
      : DKE(round_up(a.Dk, 2)), DVB(round_up(a.Dv, NB)), kt_tile(BK * round_up(a.Dk, 2)),
        vps(BK * (a.cache_kt ? a.NKP / BK : SPAN)), q(aligned_array<T>(R * round_up(a.Dk, 2))),
        p(aligned_array<T>(R * SPAN * BK)), stage(aligned_array<T>(BK * NB)),
        s(aligned_array<float>(R * SPAN * BK)), mx(aligned_array<float>(R)), cache(a.cache_kt),
        onednn_pack(a.lowp_onednn_pack) {
    const i64 tiles = cache ? a.NKP / BK : SPAN;
    kt = aligned_array<T>(tiles * kt_tile);
    v = aligned_array<T>(vps * DVB);
    done.assign(tiles, 0);
    v_bad.assign(tiles, 0);
  }
  T* v_at(i64 t) { return v.get() + t * BK * NB; }        // tile t's rows in plane 0
  // The cache slot of the tile at k0 (a multiple of BK) of head h of batch / sequence b; the
  // slots are cleared when the head changes (the cache holds one head at a time).
  i64 slot(i64 b, i64 h, i64 k0) {
    if (cb != b || ch != h) {
      std::fill(done.begin(), done.end(), 0);
      cb = b;
      ch = h;
    }
    return k0 / BK;
  }
};

// dst (DKE,) <- a query row src (D_k,) in T, zero padded.
template <typename T> inline void q_row_lowp(const T* src, i64 Dk, i64 DKE, T* dst) {
  std::memcpy(dst, src, Dk * sizeof(T));
  std::fill(dst + Dk, dst + DKE, T(0.f));
}

// Q (R, DKE) <- the item's query rows in T, G heads stacked, zero padded.
template <typename A, typename T>
void gather_q_lowp(const Args<A>& a, const T* q, const Item& it, LowpBuffers<T>& lb) {
  for (i64 g = 0; g < a.G; ++g)
    for (i64 i = 0; i < it.nr; ++i) {                     // row g * nr + i (DKE,)
      const T* src = q + it.b * a.sq[0] + (it.kvh * a.G + g) * a.sq[1] + (it.q0 + i) * a.sq[2];
      q_row_lowp(src, a.Dk, lb.DKE, lb.q.get() + (g * it.nr + i) * lb.DKE);
      if (a.q_bad && !all_finite(src, a.Dk)) a.q_bad->store(true, std::memory_order_relaxed);
    }
}

template <typename T> void pack_kt_rows(i64 Dk, const T* const* krow, i64 n, T* dst);

// dst: rows src + j * ld (j < n, D values each) transposed, (DE, BK) with DE = D rounded up
// to 2, packed as one block (DE / 2, BK, 2) by our own interleave, the layout
// scores_block_lowp reads; rows past n and dims past D are 0 (pack_kt_rows on the rows).
template <typename T> void pack_transposed_rows(const T* src, i64 ld, i64 n, i64 D, T* dst) {
  const T* rows[BK];
  for (i64 j = 0; j < n; ++j) rows[j] = src + j * ld;
  pack_kt_rows(D, rows, n, dst);
}

// The packed Kᵀ tile (DKE, BK) of keys [k0, k0 + n): one block (DKE / 2, BK, 2) by our own
// interleave (one brgemm then covers the tile's keys; oneDNN packs at most NB columns); keys
// past n and dims past D_k are 0.
template <typename A, typename T>
void pack_kt_tile(const Args<A>& a, const T* kh, i64 k0, i64 n, T* dst, LowpBuffers<T>& lb) {
  pack_transposed_rows(kh + k0 * a.sk[2], a.sk[2], n, a.Dk, dst);
}

// dst: rows src + j * ld (j < n, D values each) as a (K, DB) matrix packed as DB / NB blocks
// (K / 2, NB, 2), block c at dst + c * ps (ps >= K; K by default); K even >= n, DB = D
// rounded up to NB, rows past n and columns past D are 0, and with zero_bad so is every row
// holding inf/NaN. stage: (K, NB).
template <typename T>
void pack_rows(const T* src, i64 ld, i64 n, i64 K, i64 D, T* dst, T* stage, bool onednn_pack,
               bool zero_bad, i64 ps = 0) {
  if (ps == 0) ps = K;
  std::vector<char> bad(zero_bad ? n : 0, 0);             // (n,) rows left 0, with zero_bad
  for (i64 j = 0; zero_bad && j < n; ++j) bad[j] = !all_finite(src + j * ld, D);
  for (i64 c = 0; c < round_up(D, NB); c += NB) {         // columns [c, c + w) of src
    const i64 w = std::min<i64>(NB, D - c);
    std::fill_n(stage, K * NB, T(0.f));
    for (i64 j = 0; j < n; ++j)
      if (!zero_bad || !bad[j]) std::memcpy(stage + j * NB, src + j * ld + c, w * sizeof(T));
    vnni_pack(K, NB, stage, dst + c * ps, onednn_pack);
  }
}

// The packed V tile of keys [k0, k0 + n): DVB / NB blocks (BK / 2, NB, 2) (pack_rows), lb.vps
// apart (LowpBuffers' planes), rows past n and columns past D_v 0; returns the first row holding inf/NaN (BK if none: the zero
// rows past n are finite).
template <typename A, typename T>
i64 pack_v_tile(const Args<A>& a, const T* vh, i64 k0, i64 n, T* dst, LowpBuffers<T>& lb) {
  const T* v0 = vh + k0 * a.sv[2];
  pack_rows(v0, a.sv[2], n, BK, a.Dv, dst, lb.stage.get(), lb.onednn_pack, false, lb.vps);
  for (i64 j = 0; j < n; ++j)
    if (!all_finite(v0 + j * a.sv[2], a.Dv)) return j;
  return BK;
}

// The tile's packed Kᵀ and V (from the head's cache, packed on first use; else into slot
// part of the span's), and V's first non-finite row.
template <typename A, typename T>
void packed_tile(const Args<A>& a, const T* kh, const T* vh, const Item& it, i64 k0, i64 n,
                 int part, LowpBuffers<T>& lb, const T*& kt, const T*& v, i64& v_bad) {
  i64 t = part, len = n;
  if (lb.cache) {                                         // k0 is a multiple of BK here
    t = lb.slot(it.b, it.kvh, k0);
    len = std::min<i64>(BK, a.Nk - k0);                   // the whole tile, for every item
  }
  T* ktt = lb.kt.get() + t * lb.kt_tile;
  T* vt = lb.v_at(t);
  if (!lb.cache || !lb.done[t]) {
    pack_kt_tile(a, kh, k0, len, ktt, lb);
    lb.v_bad[t] = pack_v_tile(a, vh, k0, len, vt, lb);
    screen_kv_rows(a, kh + k0 * a.sk[2], a.sk[2], vh + k0 * a.sv[2], a.sv[2], len, lb.v_bad[t]);
    lb.done[t] = 1;
  }
  kt = ktt;
  v = vt;
  v_bad = lb.v_bad[t];
}

// ------------------------------------------------------------------ the two GEMMs
// brgemm's product on the same operands, in plain C++ (the test mode): C (M, N) (ld ldc)
// (+)= A (M, K) (ld lda) . B, B in the VNNI layout with ld ldb (element (k, n) at
// [k / 2][n][k % 2]; K even, as every call here has).
template <typename T>
void emulated_brgemm(i64 M, i64 N, i64 K, i64 lda, i64 ldb, i64 ldc, bool add, const T* A,
                     const T* B, float* C) {
  for (i64 i = 0; i < M; ++i)                             // row i of C (N,)
    for (i64 n = 0; n < N; ++n) {
      float acc = add ? C[i * ldc + n] : 0.f;
      for (i64 k = 0; k < K; ++k)
        acc += float(A[i * lda + k]) * float(B[(k / 2) * ldb * 2 + n * 2 + k % 2]);
      C[i * ldc + n] = acc;
    }
}

template <typename T>
inline void lowp_brgemm(bool emulate, i64 M, i64 N, i64 K, i64 lda, i64 ldb, i64 ldc, bool add,
                        const T* A, const T* B, float* C) {
  if (emulate) return emulated_brgemm(M, N, K, lda, ldb, ldc, add, A, B, C);
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add, A, B, C, true);
}

// S[r0 : r0 + m, j0 : j0 + nj] (ld ldc) <- Q rows . Kᵀ columns [j0, j0 + nj), one brgemm.
template <typename T>
inline void scores_block_lowp(bool emulate, const T* q, i64 DKE, const T* kt, i64 r0, i64 m,
                              i64 j0, i64 nj, float* s, i64 ldc = BK) {
  lowp_brgemm(emulate, m, nj, DKE, DKE, BK, ldc, false, q + r0 * DKE, kt + j0 * 2,
              s + r0 * ldc + j0);
}

// acc[r0 : r0 + m, :D_v] (ld DVP) += P[r0 : r0 + m, j0 : j0 + nj] (ld lda) . V rows [j0, j0 +
// nj), one brgemm per VNNI block of V's columns, the blocks vps apart (nj rounded up to 2:
// P and V are 0 past the keys).
template <typename T>
inline void values_block_lowp(bool emulate, const T* p, const T* v, i64 Dv, i64 DVP, i64 r0,
                              i64 m, i64 j0, i64 nj, float* acc, i64 lda = BK, i64 vps = BK) {
  const i64 ke = round_up(nj, 2);
  for (i64 c = 0; c < Dv; c += NB)                        // columns [c, c + NB) of V
    lowp_brgemm(emulate, m, std::min<i64>(NB, Dv - c), ke, lda, NB, DVP, true,
                p + r0 * lda + j0, v + c * vps + j0 * NB, acc + r0 * DVP + c);
}


// ------------------------------------------------------------------ packing from row pointers
// A paged cache's tile (paged.h) has its K / V rows in pages of a pool, found one by one
// through a block table: these pack from a list of row addresses, in attnkit's own
// interleave (vnni_pack's without oneDNN). A pair of T is one 32-bit word: in a Kᵀ block,
// word (p, j) is key j's dims 2p, 2p + 1 (a transpose of words); in a V block, word (p, n)
// is column n of rows 2p, 2p + 1 (two rows interleaved).

// Whether brgemm reads attnkit's own interleave right on this CPU (probe_product on it;
// probe() tested oneDNN's where oneDNN packs). Once per process and dtype.
template <typename T> bool own_pack_ok() {
  static const bool ok = [] {
    try {
      return probe_layouts<T>(false);
    } catch (const std::exception&) {
      return false;
    }
  }();
  return ok;
}

// The path of a GEMM loop that packs by pack_kt_rows / pack_v_rows: lowp_path's, widening
// where brgemm does not read our own interleave.
template <typename T> LowpPath rows_lowp_path() {
  LowpPath p = lowp_path<T>();
  if (p.gemm && !p.emulate && p.onednn_pack) {
    if (!own_pack_ok<T>())
      return {false, false, "widening to float32: the brgemm self-test on attnkit's packing "
                            "failed"};
    p.onednn_pack = false;
  }
  return p;
}

// Eight 32-bit lanes (floats, or any 4-byte words: the shuffles move bits as they are).
typedef float v8f __attribute__((vector_size(32)));

// dst + i * ld (8,) <- column i of the 8 x 8 block r (rows r[0..7]), in registers
// (unpack pairs, then quads, then halves).
inline void transpose8_store(const v8f (&r)[8], float* dst, i64 ld) {
  v8f t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = __builtin_shufflevector(r[2 * i], r[2 * i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    t[2 * i + 1] = __builtin_shufflevector(r[2 * i], r[2 * i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  for (int h = 0; h < 2; ++h)                              // rows 0-3 (h = 0), 4-7 (h = 1)
    for (int i = 0; i < 2; ++i) {
      const v8f a = t[4 * h + i], b = t[4 * h + 2 + i];
      u[4 * h + 2 * i] = __builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13);
      u[4 * h + 2 * i + 1] = __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15);
    }
  for (int i = 0; i < 4; ++i) {                            // u[i]: columns i, i + 4 of 0-3
    const v8f lo = __builtin_shufflevector(u[i], u[4 + i], 0, 1, 2, 3, 8, 9, 10, 11);
    const v8f hi = __builtin_shufflevector(u[i], u[4 + i], 4, 5, 6, 7, 12, 13, 14, 15);
    std::memcpy(dst + i * ld, &lo, sizeof lo);
    std::memcpy(dst + (i + 4) * ld, &hi, sizeof hi);
  }
}

// dst (cols, ld_dst) = srcᵀ for src (rows, ld_src) with rows x cols used. float: 8 x 8
// blocks in registers (transpose8_store), the rest one by one (one by one, the backward's
// transposes of P and dS were a tenth of the fp32 causal backward at N = 2048).
template <typename A>
inline void transpose(const A* src, i64 rows, i64 cols, i64 ld_src, A* dst, i64 ld_dst) {
  i64 i0 = 0;
  if constexpr (std::is_same_v<A, float>) {
    for (; i0 + 8 <= rows; i0 += 8) {                      // src rows [i0, i0 + 8)
      i64 j0 = 0;
      for (; j0 + 8 <= cols; j0 += 8) {                    // src columns [j0, j0 + 8)
        v8f r[8];
        for (int u = 0; u < 8; ++u) std::memcpy(&r[u], src + (i0 + u) * ld_src + j0, sizeof r[u]);
        transpose8_store(r, dst + j0 * ld_dst + i0, ld_dst);
      }
      for (i64 j = j0; j < cols; ++j)
        for (i64 i = i0; i < i0 + 8; ++i) dst[j * ld_dst + i] = src[i * ld_src + j];
    }
  }
  for (i64 i = i0; i < rows; ++i)
    for (i64 j = 0; j < cols; ++j) dst[j * ld_dst + i] = src[i * ld_src + j];
}

// dst (DKE, BK) <- the packed Kᵀ tile of the n rows krow[j] (D_k,), as pack_kt_tile: one
// block (DKE / 2, BK, 2); keys past n and dims past D_k are 0. Eight keys by eight words
// are transposed in registers (transpose8_store); the words past the last 8 (D_k not a
// multiple of 16) and the keys of a last group of fewer than 8 one by one.
template <typename T> void pack_kt_rows(i64 Dk, const T* const* krow, i64 n, T* dst) {
  const i64 P = (Dk + 1) / 2, full = Dk / 2;             // words per key; of two dims
  const i64 P8 = full / 8 * 8;                            // words transposed 8 x 8
  float* bw = reinterpret_cast<float*>(dst);              // as words (P, BK)
  for (i64 j0 = 0; j0 < BK; j0 += 8) {                    // keys j0 .. j0 + 7
    i64 p0 = 0;
    if (j0 + 8 <= n)
      for (; p0 < P8; p0 += 8) {                          // words p0 .. p0 + 7 of 8 keys
        v8f r[8];
        for (int u = 0; u < 8; ++u) std::memcpy(&r[u], krow[j0 + u] + 2 * p0, sizeof r[u]);
        transpose8_store(r, bw + p0 * BK + j0, BK);
      }
    for (i64 j = j0; j < j0 + 8; ++j) {                   // key j -> column j, words p0..
      T* col = dst + 2 * j;
      if (j >= n) {
        for (i64 p = p0; p < P; ++p) col[p * 2 * BK] = col[p * 2 * BK + 1] = T(0.f);
        continue;
      }
      const T* kr = krow[j];
      for (i64 p = p0; p < full; ++p) std::memcpy(col + p * 2 * BK, kr + 2 * p, 2 * sizeof(T));
      if (P > full) {                                     // odd D_k: the last dim, then 0
        col[full * 2 * BK] = kr[Dk - 1];
        col[full * 2 * BK + 1] = T(0.f);
      }
    }
  }
}

// Whether x is inf or NaN (every exponent bit set).
inline bool nonfinite_bits(at::BFloat16 x) { return (x.x & 0x7F80) == 0x7F80; }
inline bool nonfinite_bits(at::Half x) { return (x.x & 0x7C00) == 0x7C00; }
template <typename T> constexpr uint16_t EXP_BITS = std::is_same_v<T, at::BFloat16> ? 0x7F80
                                                                                   : 0x7C00;

// out[0 : 32] <- a[0 : 16], b[0 : 16] interleaved (a[i], b[i] as one 32-bit word i), as
// bits; bad |= lanes where a or b holds an inf/NaN.
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16w __attribute__((vector_size(64)));
template <typename T> inline void interleave16(const T* a, const T* b, T* out, v16h& bad) {
  v16h x, y;
  std::memcpy(&x, a, sizeof x);
  std::memcpy(&y, b, sizeof y);
  const v16w w = __builtin_convertvector(x, v16w) | (__builtin_convertvector(y, v16w) << 16);
  std::memcpy(out, &w, sizeof w);
  bad |= (v16h)((x & EXP_BITS<T>) == EXP_BITS<T>) | (v16h)((y & EXP_BITS<T>) == EXP_BITS<T>);
}

// Whether any lane of m is set.
inline bool any_lane(const v16h& m) {
  uint64_t w[4];
  static_assert(sizeof w == sizeof m);
  std::memcpy(w, &m, sizeof w);
  return (w[0] | w[1] | w[2] | w[3]) != 0;
}

// dst (DVB / NB blocks (BK / 2, NB, 2), ps apart) <- the packed V tile of the n rows vrow[j]
// (D_v,), as pack_v_tile: rows past n and columns past D_v 0; returns the first row holding inf/NaN
// (BK if none). Block by block (its words written in order), rows 2p, 2p + 1 interleaved 16
// columns at a time (interleave16), a row past n read as zeros, the columns past the last
// 16 one by one.
template <typename T> i64 pack_v_rows(i64 Dv, const T* const* vrow, i64 n, T* dst, i64 ps = BK) {
  const i64 DVB = round_up(Dv, NB), D16 = Dv / 16 * 16;
  static const T zeros[NB] = {};                          // (NB,) columns of a row past n
  std::array<bool, BK / 2> nf{};                          // per pair: an inf/NaN in a row
  for (i64 c = 0; c < DVB; c += NB) {                     // columns [c, c + NB): one block
    const i64 w = std::min<i64>(NB, Dv - c), w16 = std::clamp<i64>(D16 - c, 0, NB);
    for (i64 p = 0; p < BK / 2; ++p) {                    // rows 2p, 2p + 1 -> word row p
      T* o = dst + c * ps + p * 2 * NB;                   // (NB, 2)
      if (2 * p >= n) {                                   // both past n: zero words
        std::fill_n(o, 2 * NB, T(0.f));
        continue;
      }
      const T* r0 = vrow[2 * p] + c;
      const T* r1 = 2 * p + 1 < n ? vrow[2 * p + 1] + c : nullptr;
      v16h bad{};
      for (i64 d = 0; d < w16; d += 16) interleave16(r0 + d, r1 ? r1 + d : zeros + d, o + 2 * d, bad);
      bool tail = false;
      for (i64 d = w16; d < w; ++d) {
        o[2 * d] = r0[d];
        o[2 * d + 1] = r1 ? r1[d] : T(0.f);
        tail |= nonfinite_bits(o[2 * d]) || nonfinite_bits(o[2 * d + 1]);
      }
      for (i64 d = w; d < NB; ++d) o[2 * d] = o[2 * d + 1] = T(0.f);
      nf[p] = nf[p] || tail || any_lane(bad);
    }
  }
  for (i64 p = 0; p < BK / 2; ++p)                        // the first pair, then which row
    if (nf[p]) {
      bool first = false;
      for (i64 d = 0; d < Dv; ++d) first |= nonfinite_bits(vrow[2 * p][d]);
      return first ? 2 * p : 2 * p + 1;
    }
  return BK;
}

}  // namespace
}  // namespace attnkit_native
