// attnkit's native CPU attention: one fused pass per key tile, online softmax, split keys.
//
// Shape legend (the Problem layout of attnkit/backends/base.py):
//   q    (B, H_q,  N_q, D_k)   k (B, H_kv, N_k, D_k)   v (B, H_kv, N_k, D_v)
//   out  (B, H_q,  N_q, D_v)   lse (B, H_q, N_q) float32
//   G = H_q / H_kv query heads share one K/V head (GQA). A work item is
//   (b, kv head, query block, key split); its R = G * rows query rows are stacked
//   head-major (row r = g * rows + i  <->  head kvh * G + g, query q0 + i).
//   Per key tile of n <= BK keys:
//     S   (R, BK)    scores, then probabilities P in place
//     acc (R, DVP)   sum_j P v_j (float32)          m, l (R,) running max / sum
//
// Order of score terms (attnkit/scores.py): S*scale -> softcap -> ALiBi -> + bias -> mask.
// Masks in closed form: band  lo <= q - k <= hi  (alignment folded in by the caller),
// padding lengths (kv_len (B), q_len (B)), documents (q_doc (B, N_q) == k_doc (B, N_k)),
// and any other mask as a dense bool tensor broadcast to (B, H_q, N_q, N_k).
// Conventions: a row with no allowed key -> out 0, LSE -inf; NaN in an allowed score
// propagates; a key with P == 0 never touches the output (NaN in masked V rows stays out).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

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

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr int BK = 128;  // keys per tile (a multiple of W)

inline vf splat(float x) { return vf{} + x; }
inline vf load(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf select(vi c, vf a, vf b) { return c ? a : b; }
inline vf iota() { vf v; for (int i = 0; i < W; ++i) v[i] = float(i); return v; }
inline i64 round_up(i64 x, i64 m) { return (x + m - 1) / m * m; }

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
inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < W; ++i) m = v[i] > m ? v[i] : m;   // once per row and tile
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
// caps up to 1e8; one division per lane (tanh(9) rounds to 1, so e^2f stays finite).
inline vf vtanh(vf x) {
  vf f = select(x < 0.f, -x, x);
  vf z = f * f;
  vf p = splat(-5.70498872745e-3f);
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  vf small = p * z * f + f;
  vf big = 1.f - 2.f / (vexp_core(select(f > 9.f, splat(9.f), f) * 2.f) + 1.f);
  vf r = select(f >= 0.625f, big, small);
  return select(x < 0.f, -r, r);                           // NaN -> NaN through both forms
}

// ------------------------------------------------------------------ dtype conversion
template <typename T> inline float to_f(T x) { return static_cast<float>(x); }

// dst[0:n] = float(src[0:n]), dst[n:npad] = 0.
template <typename T> inline void row_to_float(const T* src, float* dst, i64 n, i64 npad) {
  for (i64 i = 0; i < n; ++i) dst[i] = to_f(src[i]);
  for (i64 i = n; i < npad; ++i) dst[i] = 0.f;
}
template <> inline void row_to_float<float>(const float* src, float* dst, i64 n, i64 npad) {
  std::memcpy(dst, src, n * sizeof(float));
  for (i64 i = n; i < npad; ++i) dst[i] = 0.f;
}
// bfloat16 is the top half of a float32: widen and shift, W at a time.
template <> inline void row_to_float<at::BFloat16>(const at::BFloat16* src, float* dst, i64 n,
                                                    i64 npad) {
  typedef uint16_t v16 __attribute__((vector_size(W * 2)));
  typedef uint32_t v32 __attribute__((vector_size(W * 4)));
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  i64 i = 0;
  for (; i + W <= n; i += W) {
    v16 h;
    std::memcpy(&h, s + i, sizeof h);
    v32 w = __builtin_convertvector(h, v32) << 16;
    std::memcpy(dst + i, &w, sizeof w);
  }
  for (; i < n; ++i) {
    uint32_t w = uint32_t(s[i]) << 16;
    std::memcpy(dst + i, &w, 4);
  }
  for (; i < npad; ++i) dst[i] = 0.f;
}
#if defined(__F16C__)
// float16 -> float32 in registers (vcvtph2ps), W at a time.
template <> inline void row_to_float<at::Half>(const at::Half* src, float* dst, i64 n, i64 npad) {
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

// A row as float32 (npad,) in tmp. (Copying float32 rows too measured faster than
// reading them in the FMA loops: the copy streams from memory, the FMAs read L1.)
template <typename T> inline const float* as_float(const T* src, float* tmp, i64 n, i64 npad) {
  row_to_float(src, tmp, n, npad);
  return tmp;
}

// Ask for the row `ahead` keys on while this one is computed (decode is memory-bound).
template <typename T> inline void prefetch_row(const T* row, i64 n) {
  const char* p = reinterpret_cast<const char*>(row);
  for (i64 b = 0; b < n * i64(sizeof(T)); b += 64) __builtin_prefetch(p + b);
}

inline bool all_finite(const float* x, i64 n) {
  float z = 0.f;
  for (i64 i = 0; i < n; ++i) z += x[i] * 0.f;            // NaN once any x is inf/NaN
  return z == 0.f;
}

// ------------------------------------------------------------------ the call's parameters
struct Args {
  i64 B, Hq, Hkv, G, Nq, Nk, Dk, Dv, DKP, DVP;
  i64 sq[3], sk[3], sv[3];          // strides (batch, head, row) of q, k, v; last dim is 1
  float scale, softcap;             // softcap 0 = none
  const float* alibi;               // (H_q,) slopes or null
  float alibi_offset;               // distance |q + offset - k|
  const float* bias; i64 sb[4];     // (B, H_q, N_q, N_k) broadcast strides, or null
  double band_lo, band_hi;          // allowed <=> lo <= q - k <= hi
  const i64* kv_len; i64 skl;       // (B,) or null; stride 0 when broadcast
  const i64* q_len; i64 sql;
  const i64* q_doc; i64 sqd[2];     // (B, N_q) document ids or null
  const i64* k_doc; i64 skd[2];
  const bool* mask; i64 sm[4];      // (B, H_q, N_q, N_k) broadcast strides, or null
  i64 rows, n_qblocks, splits, split_len;
  i64 NKP;                          // N_k rounded up to BK
  bool cache_kt;                    // keep a head's transposed K per thread (see Buffers)
};

// One work item's rows and key range.
struct Item {
  i64 b, kvh, q0, nr;               // queries [q0, q0 + nr) of batch b, K/V head kvh
  i64 kb, ke;                       // keys this item may visit, [kb, ke)
};

// ------------------------------------------------------------------ masks in closed form
enum TileKind { EMPTY = 0, PARTIAL = 1, FULL = 2 };

// The keys any row of [q0, q0+nr) may see under band and lengths, within [lo_k, hi_k).
inline void key_range(const Args& a, Item& it, i64 lo_k, i64 hi_k) {
  double kb = double(lo_k), ke = double(hi_k);
  if (a.kv_len) ke = std::min(ke, double(a.kv_len[it.b * a.skl]));
  kb = std::max(kb, double(it.q0) - a.band_hi);                  // k >= q - hi
  ke = std::min(ke, double(it.q0 + it.nr - 1) - a.band_lo + 1);  // k <= q - lo
  it.kb = i64(std::max(kb, double(lo_k)));
  it.ke = i64(std::min(ke, double(hi_k)));
}

// Whether tile [k0, k0+n) is empty, full or partial for the item's rows.
inline TileKind classify(const Args& a, const Item& it, i64 k0, i64 n) {
  bool full = a.mask == nullptr;
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
  return full ? FULL : PARTIAL;
}

// ------------------------------------------------------------------ the fused row pass
// x (npad,) = the scores of one row (head h, query qi) against keys [k0, k0+n):
// scale, softcap, ALiBi, bias, then the mask (skipped on FULL tiles); x[n:npad] = -inf.
inline void score_terms(const Args& a, float* x, i64 n, i64 npad, i64 b, i64 h, i64 qi, i64 k0,
                        bool full) {
  const vf sc = splat(a.scale);
  if (a.softcap > 0.f) {
    const vf c = splat(a.softcap), sc_c = splat(a.scale / a.softcap);
    for (i64 j = 0; j < npad; j += W) store(x + j, c * vtanh(load(x + j) * sc_c));
  } else {
    for (i64 j = 0; j < npad; j += W) store(x + j, load(x + j) * sc);
  }
  if (a.alibi) {                                    // x -= slope * |qi + off - (k0 + j)|
    const vf slope = splat(a.alibi[h]);
    const vf lane = iota();
    for (i64 j = 0; j < npad; j += W) {
      vf d = splat(float(qi - k0 - j) + a.alibi_offset) - lane;
      d = select(d < 0.f, -d, d);
      store(x + j, load(x + j) - slope * d);
    }
  }
  if (a.bias) {
    const float* br = a.bias + b * a.sb[0] + h * a.sb[1] + qi * a.sb[2] + k0 * a.sb[3];
    const i64 s = a.sb[3];
    for (i64 j = 0; j < n; ++j) x[j] += br[j * s];
  }
  if (!full) {
    // band: allowed keys of this row are [qi - hi, qi - lo]
    double lo_k = double(qi) - a.band_hi - double(k0), hi_k = double(qi) - a.band_lo - double(k0);
    i64 jb = i64(std::clamp(lo_k, 0.0, double(n)));
    i64 je = i64(std::clamp(std::floor(hi_k) + 1.0, 0.0, double(n)));
    if (je < jb) je = jb;
    for (i64 j = 0; j < jb; ++j) x[j] = NEG_INF;
    for (i64 j = je; j < n; ++j) x[j] = NEG_INF;
    if (a.q_doc) {
      const i64 qd = a.q_doc[b * a.sqd[0] + qi * a.sqd[1]];
      const i64* kd = a.k_doc + b * a.skd[0] + k0 * a.skd[1];
      for (i64 j = 0; j < n; ++j) x[j] = kd[j * a.skd[1]] == qd ? x[j] : NEG_INF;
    }
    if (a.mask) {
      const bool* mr = a.mask + b * a.sm[0] + h * a.sm[1] + qi * a.sm[2] + k0 * a.sm[3];
      const i64 s = a.sm[3];
      for (i64 j = 0; j < n; ++j) x[j] = mr[j * s] ? x[j] : NEG_INF;
    }
  }
  for (i64 j = n; j < npad; ++j) x[j] = NEG_INF;
}

// Online softmax step on one row: x (npad,) -> P = e^(x - m_new) in place; updates the
// running max m and sum l; returns alpha = e^(m_old - m_new), the factor for acc.
inline float softmax_step(float* x, i64 npad, float& m, float& l) {
  vf vm = splat(NEG_INF);
  for (i64 j = 0; j < npad; j += W) {
    vf v = load(x + j);
    vm = v > vm ? v : vm;
  }
  const float m_new = std::max(m, hmax(vm));
  const float shift = m_new == NEG_INF ? 0.f : m_new;     // a row with no key yet: P = 0
  const vf vs = splat(shift);
  vf sum = splat(0.f);
  for (i64 j = 0; j < npad; j += W) {
    vf p = vexp_neg(load(x + j) - vs);
    store(x + j, p);
    sum += p;
  }
  const float alpha = m == NEG_INF ? 0.f : std::exp(m - shift);
  l = l * alpha + hsum(sum);
  m = m_new;
  return alpha;
}

// ------------------------------------------------------------------ per-thread buffers
// kt holds Kᵀ for brgemm: one tile (D_k, BK), or — when cache_kt — the whole head
// (D_k, NKP), filled tile by tile as the thread's items of that head need them. It is
// allocated (uninitialised) on first use: the dot-product path never needs it.
struct Buffers {
  std::vector<float> q, s, acc, v, row, tmp4, m, l;
  std::unique_ptr<float[]> kt;
  std::vector<char> kt_done;        // (NKP / BK,) tiles of the cached head transposed
  i64 kt_b = -1, kt_h = -1;         // the cached head
  Buffers(const Args& a, i64 R)
      : q(R * a.DKP), s(R * BK), acc(R * a.DVP), v(BK * a.DVP), row(std::max(a.DKP, a.DVP)),
        tmp4(4 * std::max(a.DKP, a.DVP)), m(R), l(R) {}
  float* kt_buffer(const Args& a) {
    if (!kt) {
      kt.reset(new float[a.Dk * (a.cache_kt ? a.NKP : BK)]);
      kt_done.assign(a.cache_kt ? a.NKP / BK : 0, 0);
    }
    return kt.get();
  }
};

// Qs (R, DKP) <- the item's query rows, G heads stacked, float32, zero padded.
template <typename T> void gather_q(const Args& a, const T* q, const Item& it, Buffers& buf) {
  for (i64 g = 0; g < a.G; ++g)
    for (i64 i = 0; i < it.nr; ++i) {
      const T* src = q + it.b * a.sq[0] + (it.kvh * a.G + g) * a.sq[1] + (it.q0 + i) * a.sq[2];
      row_to_float(src, buf.q.data() + (g * it.nr + i) * a.DKP, a.Dk, a.DKP);
    }
}

// kt (D_k, ld) at column 0 <- K rows [k0, k0 + n) transposed, in float32.
template <typename T>
void transpose_tile(const Args& a, const T* kh, i64 k0, i64 n, float* kt, i64 ld,
                    Buffers& buf) {
  float* row = buf.row.data();
  for (i64 j = 0; j < n; ++j) {                          // kt[d, j] = k[k0 + j, d]
    row_to_float(kh + (k0 + j) * a.sk[2], row, a.Dk, a.Dk);
    for (i64 d = 0; d < a.Dk; ++d) kt[d * ld + j] = row[d];
  }
}

// S (R, BK) <- Qs (R, D_k) . K_tileᵀ through brgemm on the transposed tile.
template <typename T>
void scores_gemm(const Args& a, const T* kh, const Item& it, i64 k0, i64 n, i64 R,
                 Buffers& buf) {
  float* kt = buf.kt_buffer(a);
  i64 ld = BK;
  if (a.cache_kt) {                                      // k0 is a multiple of BK here
    if (buf.kt_b != it.b || buf.kt_h != it.kvh) {
      std::fill(buf.kt_done.begin(), buf.kt_done.end(), 0);
      buf.kt_b = it.b;
      buf.kt_h = it.kvh;
    }
    if (!buf.kt_done[k0 / BK]) {
      transpose_tile(a, kh, k0, std::min<i64>(BK, a.Nk - k0), kt + k0, a.NKP, buf);
      buf.kt_done[k0 / BK] = 1;
    }
    kt += k0;
    ld = a.NKP;
  } else {
    transpose_tile(a, kh, k0, n, kt, BK, buf);
  }
  at::native::cpublas::brgemm(R, n, a.Dk, a.DKP, ld, BK, false, buf.q.data(), kt, buf.s.data(),
                              false);
}

// S (R, BK) <- one dot product per (row, key); four keys at a time (four independent
// accumulators), each K row read once for all R rows.
template <typename T>
void scores_dot(const Args& a, const T* kh, i64 k0, i64 n, i64 R, Buffers& buf) {
  float* tmp = buf.tmp4.data();                            // (4, DKP) converted K rows
  i64 j = 0;
  for (; j + 4 <= n; j += 4) {
    const float* kj[4];
    for (int u = 0; u < 4; ++u) {
      if (k0 + j + u + 16 < a.Nk) prefetch_row(kh + (k0 + j + u + 16) * a.sk[2], a.Dk);
      kj[u] = as_float(kh + (k0 + j + u) * a.sk[2], tmp + u * a.DKP, a.Dk, a.DKP);
    }
    for (i64 r = 0; r < R; ++r) {
      const float* qr = buf.q.data() + r * a.DKP;
      vf s0 = splat(0.f), s1 = s0, s2 = s0, s3 = s0;
      for (i64 d = 0; d < a.DKP; d += W) {
        const vf qd = load(qr + d);
        s0 += qd * load(kj[0] + d); s1 += qd * load(kj[1] + d);
        s2 += qd * load(kj[2] + d); s3 += qd * load(kj[3] + d);
      }
      float* sr = buf.s.data() + r * BK + j;
      sr[0] = hsum(s0); sr[1] = hsum(s1); sr[2] = hsum(s2); sr[3] = hsum(s3);
    }
  }
  for (; j < n; ++j) {
    const float* kj = as_float(kh + (k0 + j) * a.sk[2], tmp, a.Dk, a.DKP);  // k_j (DKP,)
    for (i64 r = 0; r < R; ++r) {
      const float* qr = buf.q.data() + r * a.DKP;
      vf acc = splat(0.f);
      for (i64 d = 0; d < a.DKP; d += W) acc += load(qr + d) * load(kj + d);
      buf.s[r * BK + j] = hsum(acc);
    }
  }
}

// acc (R, D_v) += P (R, [j]) . v_j for one key, rows with P == 0 skipped (the row of V is
// read only when some row uses it, so NaN in masked V rows stays out).
template <typename T>
inline void value_one(const Args& a, const T* vh, i64 k0, i64 j, i64 R, Buffers& buf) {
  const float* vj = nullptr;
  for (i64 r = 0; r < R; ++r) {
    const float p = buf.s[r * BK + j];
    if (p == 0.f) continue;
    if (!vj) vj = as_float(vh + (k0 + j) * a.sv[2], buf.tmp4.data(), a.Dv, a.DVP);
    float* ar = buf.acc.data() + r * a.DVP;
    const vf vp = splat(p);
    for (i64 d = 0; d < a.DVP; d += W) store(ar + d, load(ar + d) + vp * load(vj + d));
  }
}

// acc (R, D_v) += P (R, n) . V_tile (n, D_v), four keys per pass over acc where all their
// P are nonzero, else key by key (value_one).
template <typename T>
void values_axpy(const Args& a, const T* vh, i64 k0, i64 n, i64 R, Buffers& buf) {
  float* tmp = buf.tmp4.data();                            // (4, DVP) converted V rows
  i64 j = 0;
  for (; j + 4 <= n; j += 4) {
    bool dense = true;
    for (i64 r = 0; r < R && dense; ++r)
      for (int u = 0; u < 4; ++u) dense = dense && buf.s[r * BK + j + u] != 0.f;
    if (!dense) {
      for (int u = 0; u < 4; ++u) value_one(a, vh, k0, j + u, R, buf);
      continue;
    }
    const float* vj[4];
    for (int u = 0; u < 4; ++u) {
      if (k0 + j + u + 16 < a.Nk) prefetch_row(vh + (k0 + j + u + 16) * a.sv[2], a.Dv);
      vj[u] = as_float(vh + (k0 + j + u) * a.sv[2], tmp + u * a.DVP, a.Dv, a.DVP);
    }
    for (i64 r = 0; r < R; ++r) {
      const float* pr = buf.s.data() + r * BK + j;
      const vf p0 = splat(pr[0]), p1 = splat(pr[1]), p2 = splat(pr[2]), p3 = splat(pr[3]);
      float* ar = buf.acc.data() + r * a.DVP;
      for (i64 d = 0; d < a.DVP; d += W)
        store(ar + d, load(ar + d) + p0 * load(vj[0] + d) + p1 * load(vj[1] + d)
                                   + p2 * load(vj[2] + d) + p3 * load(vj[3] + d));
    }
  }
  for (; j < n; ++j) value_one(a, vh, k0, j, R, buf);
}

// acc (R, D_v) += P (R, n) . V_tile through brgemm (V converted to float32 when needed);
// a tile holding inf/NaN takes the exact P == 0-skipping path instead.
template <typename T>
void values_gemm(const Args& a, const T* vh, i64 k0, i64 n, i64 R, Buffers& buf) {
  const float* vt;
  i64 ldv;
  if constexpr (std::is_same_v<T, float>) {
    vt = vh + k0 * a.sv[2];
    ldv = a.sv[2];
    for (i64 j = 0; j < n; ++j)
      if (!all_finite(vt + j * ldv, a.Dv)) return values_axpy(a, vh, k0, n, R, buf);
  } else {
    for (i64 j = 0; j < n; ++j)
      row_to_float(vh + (k0 + j) * a.sv[2], buf.v.data() + j * a.DVP, a.Dv, a.DVP);
    if (!all_finite(buf.v.data(), n * a.DVP)) return values_axpy(a, vh, k0, n, R, buf);
    vt = buf.v.data();
    ldv = a.DVP;
  }
  at::native::cpublas::brgemm(R, a.Dv, n, BK, ldv, a.DVP, true, buf.s.data(), vt,
                              buf.acc.data(), false);
}

// ------------------------------------------------------------------ one work item
// Rows of the item over its keys: acc, m, l in buf (R = G * nr rows).
template <typename T>
void attend_item(const Args& a, const T* q, const T* k, const T* v, const Item& it,
                 Buffers& buf) {
  const i64 R = a.G * it.nr;
  const bool gemm = R >= 16;                               // brgemm pays off from 16 rows
  std::fill(buf.acc.begin(), buf.acc.begin() + R * a.DVP, 0.f);
  std::fill(buf.m.begin(), buf.m.begin() + R, NEG_INF);
  std::fill(buf.l.begin(), buf.l.begin() + R, 0.f);
  if (it.ke <= it.kb || it.nr <= 0) return;
  gather_q(a, q, it, buf);
  const T* kh = k + it.b * a.sk[0] + it.kvh * a.sk[1];
  const T* vh = v + it.b * a.sv[0] + it.kvh * a.sv[1];
  // key tiles [k0, k0 + n) on the global grid of BK keys (keys before kb are masked)
  for (i64 k0 = it.kb / BK * BK; k0 < it.ke; k0 += BK) {
    const i64 n = std::min<i64>(BK, it.ke - k0), npad = round_up(n, W);
    const TileKind kind = classify(a, it, k0, n);
    if (kind == EMPTY) continue;
    if (gemm) scores_gemm(a, kh, it, k0, n, R, buf); else scores_dot(a, kh, k0, n, R, buf);
    for (i64 r = 0; r < R; ++r) {                          // row r: head h, query qi
      const i64 h = it.kvh * a.G + r / it.nr, qi = it.q0 + r % it.nr;
      float* x = buf.s.data() + r * BK;
      score_terms(a, x, n, npad, it.b, h, qi, k0, kind == FULL);
      const float alpha = softmax_step(x, npad, buf.m[r], buf.l[r]);
      if (alpha != 1.f) {
        float* ar = buf.acc.data() + r * a.DVP;
        for (i64 d = 0; d < a.DVP; ++d) ar[d] *= alpha;
      }
    }
    if (gemm) values_gemm(a, vh, k0, n, R, buf); else values_axpy(a, vh, k0, n, R, buf);
  }
}

// out row (D_v,) = acc / l and lse = m + log l; l == 0 (no key) -> 0 and -inf.
template <typename O>
inline void finish_row(const float* acc, float m, float l, i64 Dv, O* out, float* lse) {
  if (l == 0.f) {
    for (i64 d = 0; d < Dv; ++d) out[d] = O(0.f);
    *lse = NEG_INF;
    return;
  }
  const float inv = 1.f / l;
  for (i64 d = 0; d < Dv; ++d) out[d] = O(acc[d] * inv);
  *lse = m + std::log(l);
}

// Partials (B, H_q, N_q, C, D_v) / (B, H_q, N_q, C) -> out, lse by log-sum-exp weights.
template <typename O>
void merge_splits(const Args& a, const float* po, const float* pl, O* out, float* lse) {
  const i64 C = a.splits, rows = a.B * a.Hq * a.Nq;
  at::parallel_for(0, rows, 16, [&](i64 begin, i64 end) {
    std::vector<float> accv(a.Dv);
    for (i64 r = begin; r < end; ++r) {                    // r = flat (b, h, qi)
      const float* lr = pl + r * C;
      float M = NEG_INF;
      for (i64 c = 0; c < C; ++c) M = std::max(M, lr[c]);
      std::fill(accv.begin(), accv.end(), 0.f);
      float s = 0.f;
      bool nan = false;
      for (i64 c = 0; c < C; ++c) {
        if (lr[c] != lr[c]) nan = true;
        if (lr[c] == NEG_INF) continue;                    // an empty split adds nothing
        const float w = std::exp(lr[c] - M);
        s += w;
        const float* o = po + (r * C + c) * a.Dv;
        for (i64 d = 0; d < a.Dv; ++d) accv[d] += w * o[d];
      }
      if (nan) s = std::numeric_limits<float>::quiet_NaN();
      O* orow = out + r * a.Dv;
      if (s == 0.f) {
        for (i64 d = 0; d < a.Dv; ++d) orow[d] = O(0.f);
        lse[r] = NEG_INF;
      } else {
        for (i64 d = 0; d < a.Dv; ++d) orow[d] = O(accv[d] / s);
        lse[r] = M + std::log(s);
      }
    }
  });
}

// All items in parallel: item -> (b, kv head, query block (zig-zag), split).
template <typename T>
void run(const Args& a, const T* q, const T* k, const T* v, T* out, float* lse) {
  const i64 C = a.splits, NQB = a.n_qblocks;
  const i64 n_items = a.B * a.Hkv * NQB * C;
  std::vector<float> po, pl;
  if (C > 1) {
    po.assign(a.B * a.Hq * a.Nq * C * a.Dv, 0.f);
    pl.assign(a.B * a.Hq * a.Nq * C, NEG_INF);
  }
  at::parallel_for(0, n_items, 1, [&](i64 begin, i64 end) {
    Buffers buf(a, a.G * a.rows);
    for (i64 t = begin; t < end; ++t) {
      const i64 c = t % C, zq = (t / C) % NQB, kvh = (t / (C * NQB)) % a.Hkv;
      const i64 b = t / (C * NQB * a.Hkv);
      // zig-zag over query blocks: contiguous thread ranges mix early (cheap, causal)
      // and late (dear) blocks
      const i64 qb = (zq % 2 == 0) ? zq / 2 : NQB - 1 - zq / 2;
      Item it{b, kvh, qb * a.rows, 0, 0, 0};
      i64 q_end = std::min(a.Nq, it.q0 + a.rows);
      i64 valid = a.q_len ? std::min(q_end, a.q_len[b * a.sql]) : q_end;
      it.nr = std::max<i64>(0, valid - it.q0);
      key_range(a, it, c * a.split_len, std::min(a.Nk, (c + 1) * a.split_len));
      attend_item(a, q, k, v, it, buf);
      for (i64 g = 0; g < a.G; ++g)                        // rows [q0, q_end) of each head
        for (i64 i = 0; i < q_end - it.q0; ++i) {
          const i64 h = kvh * a.G + g, qi = it.q0 + i, r = g * it.nr + i;
          const bool ok = i < it.nr;
          const float* acc = buf.acc.data() + (ok ? r : 0) * a.DVP;
          const float m = ok ? buf.m[r] : NEG_INF, l = ok ? buf.l[r] : 0.f;
          const i64 flat = (b * a.Hq + h) * a.Nq + qi;
          if (C == 1)
            finish_row(acc, m, l, a.Dv, out + flat * a.Dv, lse + flat);
          else
            finish_row(acc, m, l, a.Dv, po.data() + (flat * C + c) * a.Dv, pl.data() + flat * C + c);
        }
    }
  });
  if (C > 1) merge_splits(a, po.data(), pl.data(), out, lse);
}

// ------------------------------------------------------------------ the operator
template <typename P> const P* opt_ptr(const std::optional<Tensor>& t) {
  return t.has_value() ? t->data_ptr<P>() : nullptr;
}

std::tuple<Tensor, Tensor> attend(
    const Tensor& q, const Tensor& k, const Tensor& v, double scale, double softcap,
    const std::optional<Tensor>& alibi, double alibi_offset, const std::optional<Tensor>& bias,
    double band_lo, double band_hi, const std::optional<Tensor>& kv_len,
    const std::optional<Tensor>& q_len, const std::optional<Tensor>& q_doc,
    const std::optional<Tensor>& k_doc, const std::optional<Tensor>& mask, int64_t splits,
    int64_t block_q) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "attnkit native: q, k, v must be 4-D (B, H, N, D)");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "attnkit native: the last dim of q, k, v must be contiguous");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "attnkit native: q, k, v must share one dtype");
  Args a{};
  a.B = q.size(0); a.Hq = q.size(1); a.Nq = q.size(2); a.Dk = q.size(3);
  a.Hkv = k.size(1); a.Nk = k.size(2); a.Dv = v.size(3);
  a.G = a.Hq / a.Hkv;
  a.DKP = round_up(a.Dk, W); a.DVP = round_up(a.Dv, W);
  for (int i = 0; i < 3; ++i) { a.sq[i] = q.stride(i); a.sk[i] = k.stride(i); a.sv[i] = v.stride(i); }
  a.scale = float(scale); a.softcap = float(softcap);
  a.alibi = opt_ptr<float>(alibi); a.alibi_offset = float(alibi_offset);
  a.bias = opt_ptr<float>(bias);
  if (a.bias) for (int i = 0; i < 4; ++i) a.sb[i] = bias->stride(i);
  a.band_lo = band_lo; a.band_hi = band_hi;
  a.kv_len = opt_ptr<int64_t>(kv_len); if (a.kv_len) a.skl = kv_len->stride(0);
  a.q_len = opt_ptr<int64_t>(q_len); if (a.q_len) a.sql = q_len->stride(0);
  a.q_doc = opt_ptr<int64_t>(q_doc); a.k_doc = opt_ptr<int64_t>(k_doc);
  if (a.q_doc) for (int i = 0; i < 2; ++i) { a.sqd[i] = q_doc->stride(i); a.skd[i] = k_doc->stride(i); }
  a.mask = opt_ptr<bool>(mask);
  if (a.mask) for (int i = 0; i < 4; ++i) a.sm[i] = mask->stride(i);
  a.rows = std::max<int64_t>(1, std::min(block_q, a.Nq));
  a.n_qblocks = (a.Nq + a.rows - 1) / a.rows;
  a.splits = std::max<int64_t>(1, std::min(splits, a.Nk));
  a.split_len = round_up((a.Nk + a.splits - 1) / a.splits, BK);  // on the tile grid
  a.splits = (a.Nk + a.split_len - 1) / a.split_len;
  a.NKP = round_up(a.Nk, BK);
  a.cache_kt = a.Dk * a.NKP * 4 <= (16 << 20);

  Tensor out = at::empty({a.B, a.Hq, a.Nq, a.Dv}, q.options());
  Tensor lse = at::empty({a.B, a.Hq, a.Nq}, q.options().dtype(at::kFloat));
  float* lp = lse.data_ptr<float>();
  switch (q.scalar_type()) {
    case at::kFloat:
      run(a, q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
          out.data_ptr<float>(), lp);
      break;
    case at::kBFloat16:
      run(a, q.data_ptr<at::BFloat16>(), k.data_ptr<at::BFloat16>(), v.data_ptr<at::BFloat16>(),
          out.data_ptr<at::BFloat16>(), lp);
      break;
    case at::kHalf:
      run(a, q.data_ptr<at::Half>(), k.data_ptr<at::Half>(), v.data_ptr<at::Half>(),
          out.data_ptr<at::Half>(), lp);
      break;
    default:
      TORCH_CHECK(false, "attnkit native: dtype ", q.scalar_type(),
                  " is not supported (use float32, bfloat16 or float16)");
  }
  return {out, lse};
}

std::string vector_width() { return std::to_string(W * 32) + "-bit"; }

}  // namespace

TORCH_LIBRARY(attnkit_native, m) {
  m.def("attend(Tensor q, Tensor k, Tensor v, float scale, float softcap, Tensor? alibi, "
        "float alibi_offset, Tensor? bias, float band_lo, float band_hi, Tensor? kv_len, "
        "Tensor? q_len, Tensor? q_doc, Tensor? k_doc, Tensor? mask, int splits, int block_q) "
        "-> (Tensor, Tensor)",
        &attend);
  m.def("vector_width() -> str", &vector_width);
}

}  // namespace attnkit_native
