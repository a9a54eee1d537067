// The forward pass: per-thread buffers, one work item (a query block of a K/V head over a
// key range), the finish and the merge of key splits (see attention.cpp for the legend).
#pragma once
#include "common.h"
#include "lowp.h"

namespace attnkit_native {
namespace {

// ------------------------------------------------------------------ per-thread buffers
// kt holds Kᵀ for brgemm: one tile (D_k, BK), or — when cache_kt — the whole head as
// NKP / BK such tiles one after another (tile-major: each (D_k, BK) block contiguous, so
// brgemm reads rows 512 bytes apart rather than a whole head's row apart, which thrashed
// L1's sets), filled tile by tile as the thread's items of that head need them. It is
// allocated (uninitialised) on first use: the dot-product path never needs it.
template <typename A> struct Buffers {
  avector<A> q, s, acc, v, row, tmp4, m, l, mx;   // mx: the rows' largest scores (rows_pass)
  avector<A> top, top2;             // (R rounded to W,) rows_pass_capped's per-row values
  std::vector<at::BFloat16> qh;     // the dot path's q in bf16 (scores_dot_bf16)
  avector<float> qp;                // ... and as pairs of dims (dots_pairs16)
  std::unique_ptr<A[]> kt;
  std::vector<char> kt_done;        // (NKP / BK,) tiles of the cached head transposed
  std::vector<char> v_seen;         // (NKP / BK,) its V tiles: 0 not read yet, 1 all finite,
                                    // 2 holding inf/NaN (values_gemm)
  i64 kt_b = -1, kt_h = -1;         // the cached head
  Buffers(const Args<A>& a, i64 R)
      : q(R * a.DKP), s(R * BK), acc(R * a.DVP), v(R >= 16 ? BK * a.DVP : 0),
        row(std::max(a.DKP, a.DVP)), tmp4(4 * std::max(a.DKP, a.DVP)), m(R), l(R),
        mx(R), top(round_up(R, W)), top2(round_up(R, W)) {}
  A* kt_buffer(const Args<A>& a) {
    if (!kt) {
      kt.reset(new A[a.Dk * (a.cache_kt ? a.NKP : BK)]);
      kt_done.assign(a.cache_kt ? a.NKP / BK : 0, 0);
      v_seen.assign(kt_done.size(), 0);
    }
    return kt.get();
  }
  // The head cache's tiles now for head h of batch b (cleared when the head changes).
  void use_head(i64 b, i64 h) {
    if (kt_b != b || kt_h != h) {
      std::fill(kt_done.begin(), kt_done.end(), 0);
      std::fill(v_seen.begin(), v_seen.end(), 0);
      kt_b = b;
      kt_h = h;
    }
  }
};

// Qs (R, DKP) <- the item's query rows, G heads stacked, in A, zero padded.
template <typename A, typename T>
void gather_q(const Args<A>& a, const T* q, const Item& it, Buffers<A>& buf) {
  for (i64 g = 0; g < a.G; ++g)
    for (i64 i = 0; i < it.nr; ++i) {
      const T* src = q + it.b * a.sq[0] + (it.kvh * a.G + g) * a.sq[1] + (it.q0 + i) * a.sq[2];
      A* row = buf.q.data() + (g * it.nr + i) * a.DKP;
      row_to_compute(src, row, a.Dk, a.DKP);
      if (a.q_bad && !all_finite(row, a.Dk)) a.q_bad->store(true, std::memory_order_relaxed);
    }
}

// kt (D_k, BK) <- K rows [k0, k0 + n) transposed, in A (rows already in A: by transpose).
template <typename A, typename T>
void transpose_tile(const Args<A>& a, const T* kh, i64 k0, i64 n, A* kt, Buffers<A>& buf) {
  if constexpr (std::is_same_v<T, A>) {
    return transpose(kh + k0 * a.sk[2], n, a.Dk, a.sk[2], kt, BK);
  }
  A* row = buf.row.data();
  for (i64 j = 0; j < n; ++j) {                          // kt[d, j] = k[k0 + j, d]
    row_to_compute(kh + (k0 + j) * a.sk[2], row, a.Dk, a.Dk);
    for (i64 d = 0; d < a.Dk; ++d) kt[d * BK + j] = row[d];
  }
}

// S (R, BK) <- Qs (R, D_k) . K_tileᵀ through brgemm (gemm) on the transposed tile, by the
// tile's sub-blocks.
template <typename A, typename T>
void scores_gemm(const Args<A>& a, const T* kh, const Item& it, i64 k0, i64 n,
                 const Sub* subs, int count, Buffers<A>& buf) {
  A* kt = buf.kt_buffer(a);
  if (a.cache_kt) {                                      // k0 is a multiple of BK here
    buf.use_head(it.b, it.kvh);
    kt += k0 / BK * (a.Dk * BK);                         // the tile's (D_k, BK) block
    if (!buf.kt_done[k0 / BK]) {
      transpose_tile(a, kh, k0, std::min<i64>(BK, a.Nk - k0), kt, buf);
      buf.kt_done[k0 / BK] = 1;
    }
  } else {
    transpose_tile(a, kh, k0, n, kt, buf);
  }
  if (count > 1) zero_skipped(subs, count, a.G, it.nr, buf.s.data());
  for_each_block(subs, count, a.G, it.nr, [&](i64 r0, i64 m, i64 j0, i64 nj) {
    gemm(m, nj, a.Dk, a.DKP, BK, BK, false, buf.q.data() + r0 * a.DKP, kt + j0,
         buf.s.data() + r0 * BK + j0);
  });
}

constexpr i64 AHEAD = 16;  // rows prefetched ahead on the dot (decode) path: 12-16 measured best
                           // here (fp32 decode 0.69 of read bandwidth, 0.62 at 48)

// The dot (decode) loops read rows of E (as_rows4): the K/V rows themselves when they have
// no padding (E = T, so a half-precision cache is read as such), else converted rows (E = A).

// S[r, u] (rows R, stride BK) <- q_r . k_u for four keys (four independent accumulators).
template <typename A, typename E>
inline void dot4(const A* q, i64 R, i64 DKP, const E* const (&kj)[4], A* s) {
  using V = vec<A>;
  for (i64 r = 0; r < R; ++r) {
    const A* qr = q + r * DKP;
    V s0 = splat(A(0)), s1 = s0, s2 = s0, s3 = s0;
    for (i64 d = 0; d < DKP; d += lanes<A>) {
      const V qd = load(qr + d);
      s0 += qd * load_vec(kj[0] + d); s1 += qd * load_vec(kj[1] + d);
      s2 += qd * load_vec(kj[2] + d); s3 += qd * load_vec(kj[3] + d);
    }
    A* sr = s + r * BK;
    sr[0] = hsum(s0); sr[1] = hsum(s1); sr[2] = hsum(s2); sr[3] = hsum(s3);
  }
}

// acc (R, DVP) += P[r, u] v_u for four keys.
template <typename A, typename E>
inline void axpy4(const A* p, i64 R, i64 DVP, const E* const (&vj)[4], A* acc) {
  using V = vec<A>;
  for (i64 r = 0; r < R; ++r) {
    const A* pr = p + r * BK;
    const V p0 = splat(pr[0]), p1 = splat(pr[1]), p2 = splat(pr[2]), p3 = splat(pr[3]);
    A* ar = acc + r * DVP;
    for (i64 d = 0; d < DVP; d += lanes<A>)
      store(ar + d, load(ar + d) + p0 * load_vec(vj[0] + d) + p1 * load_vec(vj[1] + d)
                                 + p2 * load_vec(vj[2] + d) + p3 * load_vec(vj[3] + d));
  }
}

// The dot loops find key j of a tile (j from 0) through `rows`: K row rows.k(j), V row
// rows.v(j); rows.end keys from the tile's first have rows (the prefetches stop there).
// HeadRows: one head's rows at a stride, as the forward holds them (paged.h lists them).
// Rows::ahead_bf16: the rows the bf16 dot loops (scores_dot_bf16, values_bf16) prefetch ahead.
// Rows prefetched ahead over one head's rows at a stride: 8 measured best, one core,
// alternating runs (4-12 alike; 16, the widening loops' AHEAD: (1, 8, 1, 64) over 4096 keys
// 0.88 -> 0.92 of SDPA's speed, 32/8 GQA heads D=128 over 8192 keys 39 -> 35 ns per key and
// K/V head; 16 x 4096 keys of 32/8 heads 29.0 -> 27.7 ms thread CPU time).
constexpr i64 AHEAD_BF16 = 8;
template <typename T> struct HeadRows {
  const T* kp; const T* vp;         // the tile's first K / V row
  i64 sk, sv, end;                  // row strides; rows left in the head
  static constexpr i64 ahead_bf16 = AHEAD_BF16;
  const T* k(i64 j) const { return kp + j * sk; }
  const T* v(i64 j) const { return vp + j * sv; }
};

// The rows of head (kh, vh) from key k0 on.
template <typename A, typename T>
inline HeadRows<T> head_rows(const Args<A>& a, const T* kh, const T* vh, i64 k0) {
  return {kh + k0 * a.sk[2], vh + k0 * a.sv[2], a.sk[2], a.sv[2], a.Nk - k0};
}

// Calls f with four rows as the dot loops read them (as_rows4); half-precision rows that
// several query rows read (R > 1) are converted once into tmp (4, npad) instead of once
// per query row in registers.
template <typename A, typename T, typename F>
inline void rows4_for(const T* const (&src)[4], i64 n, i64 npad, i64 R, A* tmp, F f) {
  if constexpr (!std::is_same_v<T, A>) {
    if (R > 1) {
      const A* rows[4];
      for (int u = 0; u < 4; ++u) {
        row_to_compute(src[u], tmp + u * npad, n, npad);
        rows[u] = tmp + u * npad;
      }
      return f(rows);
    }
  }
  as_rows4(src, n, npad, tmp, f);
}

#if defined(__AVX512BF16__)
// ------------------------------------------------------------------ bf16 dot products
// bfloat16 q against a bfloat16 cache where the CPU has AVX512-BF16 (the build's
// -mavx512bf16; other CPUs widen as below): K rows read as they are, pairs of dims per float
// lane (lane i: dims 2i, 2i + 1 of a chunk of KD), either by vdpbf16ps, whose products of two
// bf16 are exact in float and whose two adds per lane round to nearest (denormal inputs and
// outputs are flushed to 0: below 1.2e-38, far under the bf16 rounding q and k already
// carry), or, two query rows or more, as fp32 FMAs on the pairs (dots_pairs16: exact
// products, float sums). q is bf16 already, so nothing is rounded that was not.
constexpr int KD = 32;                                     // dims per vdpbf16ps

// The dims [d, d + KD) of a row with `left` dims from d on (fewer than KD: the rest 0).
inline __m512bh load_pairs(const at::BFloat16* p, i64 left) {
  const __mmask32 m = left >= KD ? ~__mmask32(0) : (__mmask32(1) << left) - 1;
  return (__m512bh)_mm512_maskz_loadu_epi16(m, p);
}

// The 16 lane sums of x[0..15] in one vector, x[u]'s in lane u: four halving steps, each
// adding two vectors' halves (quarters, then pairs, then single lanes) into one vector.
inline __m512 lane_sums16(const __m512 (&x)[16]) {
  __m512 b[16], c[4];
  for (int i : {0, 1, 2, 3, 8, 9, 10, 11})                 // b[i]: x[i] | x[i + 4] (8 lanes each)
    b[i] = _mm512_shuffle_f32x4(x[i], x[i + 4], 0x44) + _mm512_shuffle_f32x4(x[i], x[i + 4], 0xee);
  for (int i = 0; i < 4; ++i)                              // c[i]: x[i], x[i+4], x[i+8], x[i+12]
    c[i] = _mm512_shuffle_f32x4(b[i], b[i + 8], 0x88) + _mm512_shuffle_f32x4(b[i], b[i + 8], 0xdd);
  const __m512 d0 = _mm512_unpacklo_ps(c[0], c[1]) + _mm512_unpackhi_ps(c[0], c[1]);
  const __m512 d1 = _mm512_unpacklo_ps(c[2], c[3]) + _mm512_unpackhi_ps(c[2], c[3]);
  return (__m512)_mm512_unpacklo_pd((__m512d)d0, (__m512d)d1) +
         (__m512)_mm512_unpackhi_pd((__m512d)d0, (__m512d)d1);
}

// S[r, u] (rows R, stride BK) <- q_r . k_u for KEYS keys (16: summed across lanes at once;
// 1: the tail) by vdpbf16ps; qh (R, DKE) holds q in bf16, zero padded to DKE (KD's multiple).
template <int KEYS>
inline void dots_bf16(const at::BFloat16* qh, i64 R, i64 Dk, i64 DKE,
                      const at::BFloat16* const (&kj)[KEYS], float* s) {
  for (i64 r = 0; r < R; ++r) {
    const at::BFloat16* qr = qh + r * DKE;
    __m512 acc[KEYS];
    for (int u = 0; u < KEYS; ++u) acc[u] = _mm512_setzero_ps();
    for (i64 d = 0; d < Dk; d += KD) {                     // dims [d, d + KD)
      const __m512bh qd = (__m512bh)_mm512_loadu_si512(qr + d);
      for (int u = 0; u < KEYS; ++u) acc[u] = _mm512_dpbf16_ps(acc[u], load_pairs(kj[u] + d, Dk - d), qd);
    }
    if constexpr (KEYS == 16) _mm512_storeu_ps(s + r * BK, lane_sums16(acc));
    else for (int u = 0; u < KEYS; ++u) s[r * BK + u] = _mm512_reduce_add_ps(acc[u]);
  }
}

// The same dot products as fp32 FMAs on the pairs: a chunk of KD bf16 dims loaded as 16
// 32-bit lanes is 16 floats of its even dims (x << 16) and 16 of its odd dims
// (x & 0xffff0000), exact, in vdpbf16ps's lanes (lane i: dims 2i, 2i + 1), each multiplied by
// the matching half of qp. vdpbf16ps takes 0.52 ns a zmm here against 0.13 for an FMA, so
// two FMAs and the split beat it once the split of a K chunk serves two query rows or more.
// Per 16 keys of a (GQA 32/8, D=128) tile, one thread, rows L1-resident (bf16_dots.cpp):
// 4 rows 0.73 of vdpbf16ps's time, 2 rows 0.87, 1 row 1.33 (so one row stays on dots_bf16).

// qp (R, DKE) <- the float rows of Qs (R, DKP), each chunk of KD dims as its 16 even dims
// then its 16 odd dims (zeros from D_k to DKE).
inline void q_to_pairs(const Args<float>& a, i64 R, i64 DKE, const float* q, float* qp) {
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (i64 r = 0; r < R; ++r)
    for (i64 d = 0; d < DKE; d += KD) {                    // dims [d, d + KD): two float vectors
      const float* qr = q + r * a.DKP;
      const __m512 lo = d < a.DKP ? _mm512_loadu_ps(qr + d) : _mm512_setzero_ps();
      const __m512 hi = d + 16 < a.DKP ? _mm512_loadu_ps(qr + d + 16) : _mm512_setzero_ps();
      _mm512_storeu_ps(qp + r * DKE + d, _mm512_permutex2var_ps(lo, even, hi));
      _mm512_storeu_ps(qp + r * DKE + d + 16, _mm512_permutex2var_ps(lo, odd, hi));
    }
}

// S[r, u] (rows RB, stride BK) <- q_r . k_u for 16 keys, 16 / RB keys at a time: RB * (16 /
// RB) accumulators, each K chunk loaded and split once for the RB rows; qp (RB, DKE).
template <int RB>
inline void dots_pairs16(const float* qp, i64 Dk, i64 DKE, const at::BFloat16* const (&kj)[16],
                         float* s) {
  constexpr int KEYS = 16 / RB;
  for (int u0 = 0; u0 < 16; u0 += KEYS) {                  // keys [u0, u0 + KEYS)
    __m512 acc[16];                                        // acc[r * KEYS + u]
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (i64 d = 0; d < Dk; d += KD) {                     // (RB, KD) . (KD, KEYS)
      __m512 ke[KEYS], ko[KEYS];
      for (int u = 0; u < KEYS; ++u)
        bf16_pairs((__m512i)load_pairs(kj[u0 + u] + d, Dk - d), ke[u], ko[u]);
      for (int r = 0; r < RB; ++r) {
        const __m512 qe = _mm512_loadu_ps(qp + r * DKE + d), qo = _mm512_loadu_ps(qp + r * DKE + d + 16);
        for (int u = 0; u < KEYS; ++u)
          acc[r * KEYS + u] = _mm512_fmadd_ps(qo, ko[u], _mm512_fmadd_ps(qe, ke[u], acc[r * KEYS + u]));
      }
    }
    alignas(64) float t[16];                               // t[r * KEYS + u]
    _mm512_store_ps(t, lane_sums16(acc));
    for (int r = 0; r < RB; ++r)
      for (int u = 0; u < KEYS; ++u) s[r * BK + u0 + u] = t[r * KEYS + u];
  }
}

// S (R rows, stride BK) <- q_r . k_u for 16 keys: rows 4, then 2, at a time on the pairs
// (dots_pairs16), a last single row by vdpbf16ps (dots_bf16).
inline void dots16(const at::BFloat16* qh, const float* qp, i64 R, i64 Dk, i64 DKE,
                   const at::BFloat16* const (&kj)[16], float* s) {
  i64 r = 0;
  for (; r + 4 <= R; r += 4) dots_pairs16<4>(qp + r * DKE, Dk, DKE, kj, s + r * BK);
  if (r + 2 <= R) {
    dots_pairs16<2>(qp + r * DKE, Dk, DKE, kj, s + r * BK);
    r += 2;
  }
  if (r < R) dots_bf16<16>(qh + r * DKE, 1, Dk, DKE, kj, s + r * BK);
}

// qh (R, DKE) <- the float rows of Qs (R, DKP) in bf16 (exact: they came from bf16), zeros
// from D_k to DKE.
inline void q_to_bf16(const Args<float>& a, i64 R, i64 DKE, const float* q, at::BFloat16* qh) {
  for (i64 r = 0; r < R; ++r)
    for (i64 d = 0; d < DKE; d += KD) {                    // dims [d, d + KD): two float vectors
      const float* qr = q + r * a.DKP;
      const __m512 lo = d < a.DKP ? _mm512_loadu_ps(qr + d) : _mm512_setzero_ps();
      const __m512 hi = d + 16 < a.DKP ? _mm512_loadu_ps(qr + d + 16) : _mm512_setzero_ps();
      _mm512_storeu_si512(qh + r * DKE + d, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

// Whether the K pass also prefetches the tile's V rows (values_bf16 prefetches them as it
// reads them anyway): on a call whose K/V outgrow the cores' L2s (4 MB here), so that the V
// pass of a tile finds its rows in L2 and DRAM serves two streams during the K pass. Earlier,
// one core, alternating runs: 1x32768 D=128 (128 MB, DRAM) 7.3-7.6 ms with against 8.5-11
// without. (1, 8, 1, 64) over 4096 keys (8 MB), K/V evicted before each call, two threads,
// SDPA timed in the same process (cold.py, 8 alternating rounds of 40): 1.03-1.09x SDPA's
// speed with against 0.94-1.02x without (the 64 MB threshold this replaced); with K/V left
// in L3 between calls it costs: 0.85-0.95x against 0.99-1.09x (streaming from DRAM is what
// a decode step does: the model's weights pass through the caches between its calls).
inline bool v_with_k(const Args<float>& a) {
  return a.B * a.Hkv * a.Nk * (a.Dk + a.Dv) * i64(sizeof(at::BFloat16)) > (i64(4) << 20);
}

// scores_dot for bf16 q and K: 16 keys at a time (dots16), the tail key by key (dots_bf16<1>),
// K rows Rows::ahead_bf16 on prefetched (and the tile's V rows where v_with_k).
template <typename Rows>
void scores_dot_bf16(const Args<float>& a, const Rows& rows, i64 n, i64 R, Buffers<float>& buf) {
  const i64 DKE = round_up(a.Dk, KD);
  buf.qh.resize(R * DKE);
  q_to_bf16(a, R, DKE, buf.q.data(), buf.qh.data());
  if (R >= 2) {
    buf.qp.resize(R * DKE);
    q_to_pairs(a, R, DKE, buf.q.data(), buf.qp.data());
  }
  const bool v_too = v_with_k(a);
  constexpr i64 ahead = Rows::ahead_bf16;
  i64 j = 0;
  for (; j + 16 <= n; j += 16) {                           // keys [j, j + 16)
    const at::BFloat16* src[16];
    for (int u = 0; u < 16; ++u) {
      if (j + u + ahead < rows.end) prefetch_row(rows.k(j + u + ahead), a.Dk);
      if (v_too) prefetch_row(rows.v(j + u), a.Dv);
      src[u] = rows.k(j + u);
    }
    dots16(buf.qh.data(), buf.qp.data(), R, a.Dk, DKE, src, buf.s.data() + j);
  }
  for (; j < n; ++j) {
    const at::BFloat16* src[1] = {rows.k(j)};
    dots_bf16<1>(buf.qh.data(), R, a.Dk, DKE, src, buf.s.data() + j);
  }
}
#endif

// S (R, BK) <- one dot product per (row, key) for the tile's n keys, four keys at a time,
// each K row read once for all R rows; K rows AHEAD on and the tile's V rows prefetched.
// (bf16 with AVX512-BF16: scores_dot_bf16.)
template <typename A, typename Rows>
void scores_dot(const Args<A>& a, const Rows& rows, i64 n, i64 R, Buffers<A>& buf) {
  using V = vec<A>;
  using T = std::remove_cv_t<std::remove_pointer_t<decltype(rows.k(0))>>;
  constexpr int L = lanes<A>;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) return scores_dot_bf16(a, rows, n, R, buf);
#endif
  A* tmp = buf.tmp4.data();                                // (4, DKP) converted K rows
  i64 j = 0;
  for (; j + 4 <= n; j += 4) {
    const T* src[4];
    for (int u = 0; u < 4; ++u) {
      if (j + u + AHEAD < rows.end) prefetch_row(rows.k(j + u + AHEAD), a.Dk);
      prefetch_row(rows.v(j + u), a.Dv);                   // this tile's V, used next
      src[u] = rows.k(j + u);
    }
    rows4_for(src, a.Dk, a.DKP, R, tmp, [&](const auto& kj) {
      dot4(buf.q.data(), R, a.DKP, kj, buf.s.data() + j);
    });
  }
  for (; j < n; ++j) {
    const A* kj = as_compute(rows.k(j), tmp, a.Dk, a.DKP);  // k_j (DKP,)
    for (i64 r = 0; r < R; ++r) {
      const A* qr = buf.q.data() + r * a.DKP;
      V acc = splat(A(0));
      for (i64 d = 0; d < a.DKP; d += L) acc += load(qr + d) * load(kj + d);
      buf.s[r * BK + j] = hsum(acc);
    }
  }
}

// acc (R, D_v) += P (R, [j]) . v_j for one key, rows with P == 0 skipped (the row of V is
// read only when some row uses it, so NaN in masked V rows stays out).
template <typename A, typename Rows>
inline void value_one(const Args<A>& a, const Rows& rows, i64 j, i64 R, Buffers<A>& buf) {
  const A* vj = nullptr;
  for (i64 r = 0; r < R; ++r) {
    const A p = buf.s[r * BK + j];
    if (p == A(0)) continue;
    if (!vj) vj = as_compute(rows.v(j), buf.tmp4.data(), a.Dv, a.DVP);
    A* ar = buf.acc.data() + r * a.DVP;
    const vec<A> vp = splat(p);
    for (i64 d = 0; d < a.DVP; d += lanes<A>) store(ar + d, load(ar + d) + vp * load(vj + d));
  }
}

#if defined(__AVX512BF16__)
// bf16 V rows on the dot path: 32 dims a load, as 16 pairs per 32-bit lane whose even dims
// (x << 16) and odd dims (x & 0xffff0000) are 16 floats each, exact, with no widening
// shuffle; P stays float (fp32 FMAs). acc's dims [d, d + 32) lie as (even, odd) in registers.
struct PairDims {                                          // one chunk of 32 dims of a row
  __mmask32 v;                                             // the V row's dims in the chunk
  bool hi;                                                 // acc holds dims d + 16 .. (DVP)
};

// acc dims [d, d + 32) -> (even, odd) and back (dims beyond DVP read as 0, not written).
inline __m512 acc_half(const float* acc, bool hi, int parity) {
  const __m512 lo = _mm512_loadu_ps(acc), up = hi ? _mm512_loadu_ps(acc + 16) : _mm512_setzero_ps();
  const __m512i ie = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  return _mm512_permutex2var_ps(lo, _mm512_add_epi32(ie, _mm512_set1_epi32(parity)), up);
}
inline void acc_join(float* acc, bool hi, __m512 e, __m512 o) {
  const __m512i il = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  _mm512_storeu_ps(acc, _mm512_permutex2var_ps(e, il, o));
  if (hi) _mm512_storeu_ps(acc + 16, _mm512_permutex2var_ps(e, _mm512_add_epi32(il, _mm512_set1_epi32(8)), o));
}

// acc rows [r0, r0 + RB) x dims [d0, d0 + DC * 32) += P[r, j] v_j for keys [j0, j1), all
// their P nonzero: RB * DC * 2 accumulators held in registers over the keys.
template <int RB, int DC, typename Rows>
inline void values_pairs(const Args<float>& a, const Rows& rows, i64 j0, i64 j1, i64 r0,
                         i64 d0, const PairDims* ch, Buffers<float>& buf) {
  constexpr int N = RB * DC;                               // accumulator (r, c) at r * DC + c
  __m512 e[N], o[N];
  float* acc = buf.acc.data() + r0 * a.DVP + d0;
#pragma GCC unroll 8
  for (int i = 0; i < N; ++i) {
    e[i] = acc_half(acc + i / DC * a.DVP + i % DC * KD, ch[i % DC].hi, 0);
    o[i] = acc_half(acc + i / DC * a.DVP + i % DC * KD, ch[i % DC].hi, 1);
  }
  __mmask32 m[DC];
  for (int c = 0; c < DC; ++c) m[c] = ch[c].v;
  const float* p = buf.s.data() + r0 * BK;
  for (i64 j = j0; j < j1; ++j) {                          // key j: V row (DC * 32 dims)
    const at::BFloat16* vr = rows.v(j) + d0;
    __m512 ve[DC], vo[DC];
#pragma GCC unroll 4
    for (int c = 0; c < DC; ++c)
      bf16_pairs(_mm512_maskz_loadu_epi16(m[c], vr + c * KD), ve[c], vo[c]);
#pragma GCC unroll 8
    for (int i = 0; i < N; ++i) {
      const __m512 pr = _mm512_set1_ps(p[i / DC * BK + j]);
      e[i] = _mm512_fmadd_ps(pr, ve[i % DC], e[i]);
      o[i] = _mm512_fmadd_ps(pr, vo[i % DC], o[i]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < N; ++i)
    acc_join(acc + i / DC * a.DVP + i % DC * KD, ch[i % DC].hi, e[i], o[i]);
}

// values_pairs over rows [r0, r0 + RB) and every chunk of dims, up to DCMAX chunks a pass.
template <int RB, typename Rows>
inline void values_pairs_rows(const Args<float>& a, const Rows& rows, i64 j0, i64 j1, i64 r0,
                              const PairDims* ch, i64 chunks, Buffers<float>& buf) {
  constexpr int DCMAX = RB == 1 ? 4 : RB == 2 ? 2 : 1;     // <= 8 accumulators
  for (i64 c = 0; c < chunks; c += DCMAX) {
    const i64 d0 = c * KD;
    switch (std::min<i64>(DCMAX, chunks - c)) {
      case 4: values_pairs<RB, (DCMAX >= 4 ? 4 : 1)>(a, rows, j0, j1, r0, d0, ch + c, buf); break;
      case 3: values_pairs<RB, (DCMAX >= 3 ? 3 : 1)>(a, rows, j0, j1, r0, d0, ch + c, buf); break;
      case 2: values_pairs<RB, (DCMAX >= 2 ? 2 : 1)>(a, rows, j0, j1, r0, d0, ch + c, buf); break;
      default: values_pairs<RB, 1>(a, rows, j0, j1, r0, d0, ch + c, buf);
    }
  }
}

// values_axpy for bf16 V with fewer than 16 rows: blocks of 16 keys whose P are all nonzero
// through values_pairs (rows four at a time), the others key by key (value_one: P == 0 rows
// skipped, so NaN in masked V rows stays out).
template <typename Rows>
void values_bf16(const Args<float>& a, const Rows& rows, i64 n, i64 R, Buffers<float>& buf) {
  constexpr i64 KB = 16;                                   // keys per block
  const i64 chunks = (a.Dv + KD - 1) / KD;
  PairDims ch[(4096 + KD - 1) / KD];
  if (chunks > i64(sizeof ch / sizeof ch[0])) {
    for (i64 j = 0; j < n; ++j) value_one(a, rows, j, R, buf);
    return;
  }
  for (i64 c = 0; c < chunks; ++c) {
    const i64 left = a.Dv - c * KD;
    ch[c] = {left >= KD ? ~__mmask32(0) : (__mmask32(1) << left) - 1, left > 16};
  }
  for (i64 j0 = 0; j0 < n; j0 += KB) {
    const i64 j1 = std::min(n, j0 + KB);
    const __mmask16 keys = __mmask16((1u << (j1 - j0)) - 1);
    __mmask16 zero = 0;                                     // keys with P == 0 in some row
    for (i64 r = 0; r < R; ++r)
      zero |= _mm512_mask_cmpeq_ps_mask(keys, _mm512_loadu_ps(&buf.s[r * BK + j0]), _mm512_setzero_ps());
    if (zero) {
      for (i64 j = j0; j < j1; ++j) value_one(a, rows, j, R, buf);
      continue;
    }
    constexpr i64 ahead = Rows::ahead_bf16;
    for (i64 j = j0 + ahead; j < std::min(j1 + ahead, rows.end); ++j)  // V rows ahead
      prefetch_row(rows.v(j), a.Dv);
    i64 r0 = 0;
    for (; r0 + 4 <= R; r0 += 4) values_pairs_rows<4>(a, rows, j0, j1, r0, ch, chunks, buf);
    switch (R - r0) {
      case 3: values_pairs_rows<3>(a, rows, j0, j1, r0, ch, chunks, buf); break;
      case 2: values_pairs_rows<2>(a, rows, j0, j1, r0, ch, chunks, buf); break;
      case 1: values_pairs_rows<1>(a, rows, j0, j1, r0, ch, chunks, buf); break;
      default: break;
    }
  }
}
#endif

// acc (R, D_v) += P (R, n) . V_tile (n, D_v), four keys per pass over acc where all their
// P are nonzero, else key by key (value_one); V rows AHEAD on prefetched.
template <typename A, typename Rows>
void values_axpy(const Args<A>& a, const Rows& rows, i64 n, i64 R, Buffers<A>& buf) {
  using T = std::remove_cv_t<std::remove_pointer_t<decltype(rows.v(0))>>;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>)
    if (R < 16) return values_bf16(a, rows, n, R, buf);
#endif
  A* tmp = buf.tmp4.data();                                // (4, DVP) converted V rows
  i64 j = 0;
  for (; j + 4 <= n; j += 4) {
    bool dense = true;
    for (i64 r = 0; r < R && dense; ++r)
      for (int u = 0; u < 4; ++u) dense = dense && buf.s[r * BK + j + u] != A(0);
    if (!dense) {
      for (int u = 0; u < 4; ++u) value_one(a, rows, j + u, R, buf);
      continue;
    }
    const T* src[4];
    for (int u = 0; u < 4; ++u) {
      if (j + u + AHEAD < rows.end) prefetch_row(rows.v(j + u + AHEAD), a.Dv);
      src[u] = rows.v(j + u);
    }
    rows4_for(src, a.Dv, a.DVP, R, tmp, [&](const auto& vj) {
      axpy4(buf.s.data() + j, R, a.DVP, vj, buf.acc.data());
    });
  }
  for (; j < n; ++j) value_one(a, rows, j, R, buf);
}

// values_axpy over keys [k0, k0 + n) of head vh (the GEMM loops' exact path).
template <typename A, typename T>
void values_axpy(const Args<A>& a, const T* vh, i64 k0, i64 n, i64 R, Buffers<A>& buf) {
  values_axpy(a, head_rows(a, vh, vh, k0), n, R, buf);     // (its K rows are not read)
}


// Whether V rows [k0, k0 + n) of the item's head vh (in A) hold no inf/NaN. With the head
// cache a tile's rows are read once per head and thread (a tile whose rows do hold inf/NaN
// is checked on the item's n rows each time): a 512-key window's five items per tile read
// them five times, ~3 ms of its 85 at N = 8192 on one core.
template <typename A>
inline bool v_tile_finite(const Args<A>& a, const A* vh, const Item& it, i64 k0, i64 n,
                          Buffers<A>& buf) {
  if (a.cache_kt) {                                        // k0 is a multiple of BK here
    buf.kt_buffer(a);
    buf.use_head(it.b, it.kvh);
    char& seen = buf.v_seen[k0 / BK];
    if (seen == 0)
      seen = rows_finite(vh + k0 * a.sv[2], a.sv[2], std::min<i64>(BK, a.Nk - k0), a.Dv) ? 1 : 2;
    if (seen == 1) return true;
  }
  return rows_finite(vh + k0 * a.sv[2], a.sv[2], n, a.Dv);
}

// acc (R, D_v) += P (R, n) . V_tile through brgemm (gemm; V converted to A when needed),
// by the tile's sub-blocks (the rows a sub-block skips have P = 0 there); a tile holding
// inf/NaN takes the exact P == 0-skipping path instead.
template <typename A, typename T>
void values_gemm(const Args<A>& a, const T* vh, const Item& it, i64 k0, i64 n,
                 const Sub* subs, int count, Buffers<A>& buf) {
  const i64 R = a.G * it.nr;
  const A* vt;
  i64 ldv;
  if constexpr (std::is_same_v<T, A>) {
    vt = vh + k0 * a.sv[2];
    ldv = a.sv[2];
    if (!v_tile_finite(a, vh, it, k0, n, buf)) return values_axpy(a, vh, k0, n, R, buf);
  } else {
    for (i64 j = 0; j < n; ++j)
      row_to_compute(vh + (k0 + j) * a.sv[2], buf.v.data() + j * a.DVP, a.Dv, a.DVP);
    if (!all_finite(buf.v.data(), n * a.DVP)) return values_axpy(a, vh, k0, n, R, buf);
    vt = buf.v.data();
    ldv = a.DVP;
  }
  for_each_block(subs, count, a.G, it.nr, [&](i64 r0, i64 m, i64 j0, i64 nj) {
    gemm(m, a.Dv, nj, BK, ldv, a.DVP, true, buf.s.data() + r0 * BK + j0, vt + j0 * ldv,
         buf.acc.data() + r0 * a.DVP);
  });
}

// ------------------------------------------------------------------ low-precision GEMMs
// A key tile of a span (lowp.h SPAN): its keys [k0, k0 + n) (npad rounded to W), kind and
// sub-blocks (count of them).
struct TilePart {
  i64 k0, n, npad;
  TileKind kind;
  int count;
  Sub subs[BK / SUB];
};

// S[:, :BK] (R, ld) <- Q . K_tileᵀ in T (lowp.h), by the tile's sub-blocks.
template <typename A, typename T>
void scores_gemm_lowp(const Args<A>& a, const T* kt, const Item& it, const Sub* subs,
                      int count, A* s, i64 ld, LowpBuffers<T>& lb) {
  if (count > 1) zero_skipped(subs, count, a.G, it.nr, s, ld);
  for_each_block(subs, count, a.G, it.nr, [&](i64 r0, i64 m, i64 j0, i64 nj) {
    scores_block_lowp(a.lowp_emulate, lb.q.get(), lb.DKE, kt, r0, m, j0, nj, s, ld);
  });
}
// The same into buf.s (R, BK): one tile on its own.
template <typename A, typename T>
void scores_gemm_lowp(const Args<A>& a, const T* kt, const Item& it, const Sub* subs,
                      int count, Buffers<A>& buf, LowpBuffers<T>& lb) {
  scores_gemm_lowp(a, kt, it, subs, count, buf.s.data(), BK, lb);
}

// acc (R, D_v) += P_T (R, span's keys) . the span's V in T (P_T: P rounded to T by
// rows_pass_lowp, (R, ld)): one product over all the span's keys when no tile is cut into
// sub-blocks and the tiles' V rows follow one another in lb's planes, else tile by tile by
// sub-blocks. vp[t]: tile t's packed V (lb.v_at).
template <typename A, typename T>
void values_span_lowp(const Args<A>& a, const Item& it, const TilePart* parts, int np,
                      const T* const* vp, i64 ld, Buffers<A>& buf, LowpBuffers<T>& lb) {
  bool whole = true;
  for (int t = 0; t < np; ++t)
    whole = whole && parts[t].count == 1 && vp[t] == vp[0] + t * BK * NB;
  if (whole)
    return values_block_lowp(a.lowp_emulate, lb.p.get(), vp[0], a.Dv, a.DVP, 0, a.G * it.nr, 0,
                             (np - 1) * BK + parts[np - 1].n, buf.acc.data(), ld, lb.vps);
  for (int t = 0; t < np; ++t)
    for_each_block(parts[t].subs, parts[t].count, a.G, it.nr, [&](i64 r0, i64 m, i64 j0, i64 nj) {
      values_block_lowp(a.lowp_emulate, lb.p.get() + t * BK, vp[t], a.Dv, a.DVP, r0, m, j0, nj,
                        buf.acc.data(), ld, lb.vps);
    });
}

// ------------------------------------------------------------------ reading ahead
// The rows the next item reads first that this one leaves out of the caches: its query rows,
// the K / V rows of its tiles not yet in the thread's head cache, and its output rows (to be
// written). The float32 GEMM loop asks for them into L2 a few lines per row of the row pass
// while it computes: one core, a 512-key window at N = 8192 waited on memory ~9 ms of 85 at
// the first read of each (K's transposes, V's finiteness check, Q's gather, the output's
// stores), a tile of K and V being new to one item in five and a query row to one; 1.5-2%
// faster with it (prefetches asked in bursts, a share per tile, stalled the core instead).
struct RowsAhead {
  struct Group { const char* p; i64 rows, stride, bytes; bool write; };
  static constexpr int MAX = 24;                   // groups
  static constexpr i64 MAX_LINES = (256 << 10) / 64;  // 256 KB of L2 at most
  Group g[MAX];
  int n = 0, at = 0;                // groups; the group asked for next
  i64 row = 0, byte = 0;            // its next line: row, byte offset in the row
  i64 lines = 0;                    // lines in all groups
  // rows rows of bytes bytes, stride bytes apart, from p (groups past MAX or MAX_LINES are
  // dropped)
  void add(const void* p, i64 rows, i64 stride, i64 bytes, bool write = false) {
    if (n == MAX || rows <= 0 || lines + rows * ((bytes + 63) / 64) > MAX_LINES) return;
    g[n++] = Group{static_cast<const char*>(p), rows, stride, bytes, write};
    lines += rows * ((bytes + 63) / 64);
  }
  void ask(i64 count) {                                    // the next `count` lines, into L2
    for (; count > 0 && at < n; --count) {
      const Group& x = g[at];
      const char* r = x.p + row * x.stride + byte;
      if (x.write) __builtin_prefetch(r, 1, 2);
      else __builtin_prefetch(r, 0, 2);
      if ((byte += 64) < x.bytes) continue;
      byte = 0;
      if (++row == x.rows) {
        ++at;
        row = 0;
      }
    }
  }
};

// ahead <- the rows item nx (the thread's next) reads first on the GEMM loop in A (float32 /
// float64 inputs) that buf does not hold: its Q rows, the K and V rows of its tiles not yet
// in the head cache (without the cache, none), its output rows (out: C == 1), in that order.
template <typename A, typename T>
void rows_ahead(const Args<A>& a, const T* q, const T* k, const T* v, const T* out,
                const Item& nx, const Buffers<A>& buf, RowsAhead& ahead) {
  ahead = RowsAhead{};
  if (!std::is_same_v<T, A> || a.G * nx.nr < 16 || nx.ke <= nx.kb) return;
  for (i64 g = 0; g < a.G; ++g)
    ahead.add(q + nx.b * a.sq[0] + (nx.kvh * a.G + g) * a.sq[1] + nx.q0 * a.sq[2], nx.nr,
              a.sq[2] * i64(sizeof(T)), a.Dk * i64(sizeof(T)));
  if (a.cache_kt) {
    const bool same = buf.kt_b == nx.b && buf.kt_h == nx.kvh;
    const T* kh = k + nx.b * a.sk[0] + nx.kvh * a.sk[1];
    const T* vh = v + nx.b * a.sv[0] + nx.kvh * a.sv[1];
    for (i64 k0 = nx.kb / BK * BK; k0 < nx.ke; k0 += BK) {   // tile k0 / BK
      const i64 t = k0 / BK, rows = std::min<i64>(BK, a.Nk - k0);
      if (!same || !buf.kt_done[t])
        ahead.add(kh + k0 * a.sk[2], rows, a.sk[2] * i64(sizeof(T)), a.Dk * i64(sizeof(T)));
      if (!same || !buf.v_seen[t])
        ahead.add(vh + k0 * a.sv[2], rows, a.sv[2] * i64(sizeof(T)), a.Dv * i64(sizeof(T)));
    }
  }
  if (out)
    for (i64 g = 0; g < a.G; ++g)
      ahead.add(out + ((nx.b * a.Hq + nx.kvh * a.G + g) * a.Nq + nx.q0) * a.Dv, nx.nr,
                a.Dv * i64(sizeof(T)), a.Dv * i64(sizeof(T)), true);
}

// ------------------------------------------------------------------ one work item
// acc row r (DVP,) *= alpha, the online softmax's correction for a new running max.
template <typename A>
inline void rescale_acc_row(const Args<A>& a, Buffers<A>& buf, i64 r, A alpha) {
  if (alpha == A(1)) return;
  A* ar = buf.acc.data() + r * a.DVP;
  for (i64 d = 0; d < a.DVP; ++d) ar[d] *= alpha;
}

// Whether the row pass may take the max and the exponent on raw scores (the scale folded
// into the exponent): scale positive (the max of scaled scores is scale times the raw max)
// and no score term that needs the scaled value first. ALiBi does not (the low-precision
// pass applies it in raw units, slope / scale: x - (slope / scale) |d| is x scale - slope |d|
// before the scale); scale_folds, for the float32 pass, leaves it out too.
template <typename A> inline bool scale_folds_alibi(const Args<A>& a) {
  return a.scale > A(0) && std::isfinite(a.scale) && !(a.softcap > A(0)) && !a.mod && !a.rel &&
         !a.bias;
}
template <typename A> inline bool scale_folds(const Args<A>& a) {
  return scale_folds_alibi(a) && !a.alibi;
}

// Whether the low-precision row pass may soft-cap inside its exponent pass (rows_pass_capped):
// the soft-cap is the only score term besides the mask, scale positive and scale / c finite.
template <typename A> inline bool cap_folds(const Args<A>& a) {
  return a.softcap > A(0) && a.scale > A(0) && std::isfinite(a.scale / a.softcap) && !a.mod &&
         !a.alibi && !a.rel && !a.bias;
}

// Whether tile part tp needs its mask (or holds padding lanes): else its raw scores are all
// the row pass reads.
inline bool tile_masked(const TilePart& tp) { return tp.kind != FULL || tp.n != tp.npad; }

// The largest and smallest raw score of x (n,) (NaN skipped), two chains each.
inline void raw_range(const float* x, i64 n, vf& hi, vf& lo) {
  vf h0 = splat(NEG_INF), h1 = h0, l0 = splat(-NEG_INF), l1 = l0;
  i64 j = 0;
  for (; j + 2 * W <= n; j += 2 * W) {                    // keys [j, j + 2W)
    const vf v0 = load(x + j), v1 = load(x + j + W);
    h0 = vmax(h0, v0);
    h1 = vmax(h1, v1);
    l0 = vmin(l0, v0);
    l1 = vmin(l1, v1);
  }
  if (j < n) {
    h0 = vmax(h0, load(x + j));
    l0 = vmin(l0, load(x + j));
  }
  hi = vmax(hi, vmax(h0, h1));
  lo = vmin(lo, vmin(l0, l1));
}

// The rows' largest logits this step, W rows at a time, in form f: from the raw max hr of
// their unmasked tiles (the capped max, tanh rising; -inf where raw is false: none) and the
// largest capped score mt of their masked tiles. Exponent top2 (log2 units, as the exponent
// pass computes it for that key) and top = top2 / log2e.
template <typename F>
inline void capped_tops(vf hr, vf mt, bool raw, const F& f, vf& top, vf& top2) {
  constexpr float LOG2E = 1.44269504088896341f;
  top2 = raw ? f(hr) : splat(NEG_INF);
  top = top2 * (1.f / LOG2E);
  const vi masked_wins = mt > top;
  top = select(masked_wins, mt, top);
  top2 = select(masked_wins, rounded(mt * LOG2E), top2);  // (as exp_keys rounds it)
}

// rows_pass_capped's last two passes, the span's rows in form f: their largest logits
// (capped_tops; hr, mt (R,) -> top, top2 in place), then per row the exponents (raw tiles
// in form f, masked tiles already capped) and the online softmax's step.
template <typename A, typename T, typename F>
void capped_exponents(const Args<A>& a, const Item& it, const TilePart* parts, int np, A* s,
                      i64 ld, bool keep, bool raw, bool bounded, Buffers<A>& buf, T* p,
                      const F& f) {
  constexpr float LOG2E = 1.44269504088896341f;
  const i64 R = a.G * it.nr;
  A *hr = buf.top.data(), *mt = buf.top2.data();
  for (i64 r0 = 0; r0 < R; r0 += W) {                      // rows [r0, r0 + W) (buffers padded)
    vf top, top2;
    capped_tops(load(hr + r0), load(mt + r0), raw, f, top, top2);
    store(hr + r0, top);
    store(mt + r0, top2);
  }
  const vf vl = splat(LOG2E);
  const auto capped = [vl](vf v) { return rounded(v * vl); };
  for (i64 row = 0; row < R; ++row) {
    A* x = s + row * ld;
    T* pr = p + row * ld;
    float m_new;
    const vf vs = splat(exp_shift(hr[row], mt[row], buf.m[row], m_new));
    vf sum = splat(0.f);
    for (int t = 0; t < np;) {                             // tiles [t, u): from x + t * BK
      const bool masked = tile_masked(parts[t]);
      int u = t + 1;
      while (!masked && u < np && !tile_masked(parts[u])) ++u;   // raw tiles together
      const i64 n = (u - 1 - t) * BK + parts[u - 1].npad;
      A* xt = x + t * BK;
      T* pt = pr + t * BK;
      if (masked)
        sum += keep ? exp_keys<true>(xt, n, vs, pt, capped) : exp_keys<false>(xt, n, vs, pt, capped);
      else if (keep)
        sum += bounded ? exp_keys<true, true>(xt, n, vs, pt, f) : exp_keys<true>(xt, n, vs, pt, f);
      else
        sum += bounded ? exp_keys<false, true>(xt, n, vs, pt, f) : exp_keys<false>(xt, n, vs, pt, f);
      t = u;
    }
    rescale_acc_row(a, buf, row, exp_finish(sum, m_new, buf.m[row], buf.l[row]));
  }
}

// rows_pass_lowp with a soft-cap and no other score term (cap_folds): the tiles that need no
// mask are capped inside the exponent pass (CapExponent on their raw scores), the others in
// place first (cap_row, then the mask), as score_terms does. Passes: the rows' raw ranges
// (over every lane, before the mask: the span's largest |s r| picks the form for all its
// rows, cap_form; the odd polynomial alone below 0.625, as scale_and_cap) and raw maxima;
// the masked tiles capped and masked, and their maxima; then capped_exponents.
template <typename A, typename T>
void rows_pass_capped(const Args<A>& a, const Item& it, const TilePart* parts, int np, A* s,
                      i64 ld, bool keep, Buffers<A>& buf, T* p) {
  if constexpr (std::is_same_v<A, float>) {
    constexpr float LOG2E = 1.44269504088896341f;
    const i64 R = a.G * it.nr;
    const float r = a.scale / a.softcap;
    bool raw = false, masked = false;                      // tiles without / with mask or padding
    for (int t = 0; t < np; ++t) {
      raw = raw || !tile_masked(parts[t]);
      masked = masked || tile_masked(parts[t]);
    }
    const bool bounded = 2.f * a.softcap * LOG2E < 124.f;  // exponents >= -2 c log2e > -125
    A *hr = buf.top.data(), *mt = buf.top2.data();         // (R,) each
    vf big = splat(0.f);                                   // the span's largest |s|
    for (i64 row = 0; row < R; ++row) {
      A* x = s + row * ld;
      vf lo = splat(-NEG_INF), hi_raw = splat(NEG_INF);    // hi_raw: the unmasked tiles'
      for (int t = 0; t < np; ++t) {
        vf th = splat(NEG_INF);
        // lanes past the tile's keys hold no score yet (the GEMM wrote n): 0, not the
        // buffer's last contents, so the form chosen does not depend on them
        std::fill(x + t * BK + parts[t].n, x + t * BK + parts[t].npad, 0.f);
        raw_range(x + t * BK, parts[t].npad, th, lo);
        big = vmax(big, vabs(th));
        if (!tile_masked(parts[t])) hi_raw = vmax(hi_raw, th);
      }
      big = vmax(big, vabs(lo));
      hr[row] = raw ? hmax(hi_raw) : NEG_INF;
      mt[row] = NEG_INF;
    }
    const int form = cap_form(hmax(big) * r);              // (inf, NaN: 0)
    if (masked) {
      const vf vr = splat(r);
      const auto y_of = [vr](vf v) { return v * vr; };
      for (i64 g = 0; g < a.G; ++g)
        for (i64 i = 0; i < it.nr; ++i) {                  // row g * nr + i: head h, query qi
          const i64 h = it.kvh * a.G + g, qi = it.q0 + i, row = g * it.nr + i;
          for (int t = 0; t < np; ++t) {                   // the masked tiles, capped first
            const TilePart& tp = parts[t];
            if (!tile_masked(tp)) continue;
            A* xt = s + row * ld + t * BK;
            if (form) cap_row<true>(xt, tp.npad, static_cast<A*>(nullptr), a.scale, a.softcap, y_of);
            else cap_row<false>(xt, tp.npad, static_cast<A*>(nullptr), a.scale, a.softcap, y_of);
            position_terms_and_mask(a, xt, tp.n, tp.npad, it.b, h, qi, tp.k0, tp.kind == FULL);
            mt[row] = std::max(mt[row], row_max_lowp(xt, tp.npad));
          }
        }
    }
    if (form == 3 && CapTaylor3::fits(a.scale, a.softcap))
      capped_exponents(a, it, parts, np, s, ld, keep, raw, bounded, buf, p,
                       CapTaylor3(a.scale, a.softcap));
    else if (form == 3)
      capped_exponents(a, it, parts, np, s, ld, keep, raw, bounded, buf, p,
                       CapExponent<3>(a.scale, a.softcap));
    else if (form == 5)
      capped_exponents(a, it, parts, np, s, ld, keep, raw, bounded, buf, p,
                       CapExponent<5>(a.scale, a.softcap));
    else
      capped_exponents(a, it, parts, np, s, ld, keep, raw, bounded, buf, p,
                       CapExponent<0>(a.scale, a.softcap));
  }
}

// rows_pass on the low-precision path, pass by pass over the rows of a span's tiles parts[0
// : np) (consecutive; all but the last BK keys wide), whose scores S (R, ld) holds side by
// side: the score terms (with scale_folds_alibi, only ALiBi and the mask: the scale is
// folded into the exponent; a score_mod that takes the raw scores and the scale
// (mod_takes_scale), once over the span's keys; a soft-cap alone: rows_pass_capped) and each
// row's largest score into mx (R,), then P rounded to T into p (R, ld), acc rescaled. The
// float P stays in S only when keep (the tile's V holds inf/NaN: values_axpy reads it).
template <typename A, typename T>
void rows_pass_lowp(const Args<A>& a, const Item& it, const TilePart* parts, int np, A* s,
                    i64 ld, bool keep, Buffers<A>& buf, T* p, A* mx, RowsAhead* ahead = nullptr,
                    i64 share = 0) {
  if constexpr (std::is_same_v<A, float>) {
    if (cap_folds(a)) {
      rows_pass_capped(a, it, parts, np, s, ld, keep, buf, p);
      if (ahead) ahead->ask(share);                        // (the next item's rows: ahead)
      return;
    }
  }
  const i64 R = a.G * it.nr, width = (np - 1) * BK + parts[np - 1].npad;
  const bool fold = scale_folds_alibi(a), mod_raw = !fold && mod_takes_scale(a);
  const A c = fold ? a.scale : A(1);
  for (i64 g = 0; g < a.G; ++g)
    for (i64 i = 0; i < it.nr; ++i) {                      // row g * nr + i: head h, query qi
      const i64 h = it.kvh * a.G + g, qi = it.q0 + i;
      A* x = s + (g * it.nr + i) * ld;
      if (mod_raw) {                                       // the mod on the span's raw scores
        apply_score_mod(a, x, nullptr, (np - 1) * BK + parts[np - 1].n, it.b, h, qi, parts[0].k0,
                        double(a.scale));                  // (its keys consecutive, from x)
        for (int t = 0; t < np; ++t) {
          const TilePart& tp = parts[t];
          if (has_position_terms(a, tp.n, tp.npad, tp.kind == FULL))
            position_terms_and_mask(a, x + t * BK, tp.n, tp.npad, it.b, h, qi, tp.k0,
                                    tp.kind == FULL);
        }
      }
      for (int t = 0; t < np && !mod_raw; ++t) {          // tile t's keys, from x + t * BK
        const TilePart& tp = parts[t];
        if (fold && !a.alibi && tp.kind == FULL && tp.n == tp.npad) continue;  // nothing to do
        if (fold) position_terms_and_mask(a, x + t * BK, tp.n, tp.npad, it.b, h, qi, tp.k0,
                                          tp.kind == FULL, c);
        else score_terms(a, x + t * BK, tp.n, tp.npad, it.b, h, qi, tp.k0, tp.kind == FULL);
      }
      mx[g * it.nr + i] = row_max_lowp(x, width);       // (x still in L1)
    }
  for (i64 r = 0; r < R; ++r) {
    if (ahead) ahead->ask(share);                          // (the next item's rows: ahead)
    A* x = s + r * ld;
    const A alpha = keep ? row_exp_lowp<true>(x, width, c, mx[r], buf.m[r], buf.l[r], p + r * ld)
                         : row_exp_lowp<false>(x, width, c, mx[r], buf.m[r], buf.l[r], p + r * ld);
    rescale_acc_row(a, buf, r, alpha);
  }
}
// The same for one tile [k0, k0 + n) whose scores are in buf.s (R, BK).
template <typename A, typename T>
void rows_pass_lowp(const Args<A>& a, const Item& it, i64 k0, i64 n, i64 npad, TileKind kind,
                    bool keep, Buffers<A>& buf, T* p, A* mx, RowsAhead* ahead = nullptr,
                    i64 share = 0) {
  const TilePart tp{k0, n, npad, kind, 1, {}};
  rows_pass_lowp(a, it, &tp, 1, buf.s.data(), BK, keep, buf, p, mx, ahead, share);
}

// Each row r (head h, query qi) of the tile's scores S (R, BK): the fused score terms, the
// online softmax step (S -> P in place), acc row rescaled by alpha. float on the GEMM loops
// (R >= 16) when the scale folds (no score term but the mask): rows_pass_lowp with T = float
// and P written over S (rounding to float rounds nothing): its passes over the tile's rows
// overlap rows in the core, and the scale folds into the exponent (the dense fp32 forward at
// 4096 keys spent a quarter of its time in the row-by-row loop below). Elsewhere the loop
// below and its e^(x - m) to ~1 ulp: exp2_neg's 2e-7 put a 5000-key decode (the dot loops)
// with a relative-bias table past 2x the naive fp32 error, and 2^(x log2e - m log2e) a
// soft-capped row's LSE past 4 ulp.
template <typename A>
void rows_pass(const Args<A>& a, const Item& it, i64 k0, i64 n, i64 npad, TileKind kind,
               Buffers<A>& buf, RowsAhead* ahead = nullptr, i64 share = 0) {
  if constexpr (std::is_same_v<A, float>) {
    if (a.G * it.nr >= 16 && scale_folds(a))
      return rows_pass_lowp(a, it, k0, n, npad, kind, false, buf, buf.s.data(), buf.mx.data(),
                            ahead, share);
  }
  for (i64 r = 0; r < a.G * it.nr; ++r) {                  // row r: head h, query qi
    if (ahead) ahead->ask(share);
    const i64 h = it.kvh * a.G + r / it.nr, qi = it.q0 + r % it.nr;
    A* x = buf.s.data() + r * BK;
    score_terms(a, x, n, npad, it.b, h, qi, k0, kind == FULL);
    const A alpha = softmax_step(x, npad, buf.m[r], buf.l[r]);
    rescale_acc_row(a, buf, r, alpha);
  }
}

// body(k0, n, npad, kind, subs, count) for each key tile [k0, k0 + n) of the item that is not
// EMPTY, on the global grid of BK keys (keys before kb are masked); subs / count: the tile's
// sub-blocks when by_gemm, else one (the dot path walks the whole tile).
template <typename A, typename F>
inline void for_each_tile(const Args<A>& a, const Item& it, bool by_gemm, F&& body) {
  for (i64 k0 = it.kb / BK * BK; k0 < it.ke; k0 += BK) {
    const i64 n = std::min<i64>(BK, it.ke - k0), npad = round_up(n, W);
    const TileKind kind = classify(a, it, k0, n);
    if (kind == EMPTY) continue;
    Sub subs[BK / SUB];
    const int count = by_gemm ? tile_subs(a, it, k0, n, kind, subs) : 1;
    body(k0, n, npad, kind, static_cast<const Sub*>(subs), count);
  }
}

// The item on the low-precision path: Q, K, V in T through T GEMMs (the tiles' packed Kᵀ
// and V from the thread's cache), the score terms and the softmax in float, by spans of up
// to SPAN consecutive tiles (S and P in lb, (R, SPAN * BK)); a tile whose V holds inf/NaN
// goes on its own through buf.s and the exact values path.
template <typename A, typename T>
void attend_item_lowp(const Args<A>& a, const T* q, const T* k, const T* v, const Item& it,
                      Buffers<A>& buf, LowpBuffers<T>& lb) {
  gather_q_lowp(a, q, it, lb);
  const T* kh = k + it.b * a.sk[0] + it.kvh * a.sk[1];
  const T* vh = v + it.b * a.sv[0] + it.kvh * a.sv[1];
  constexpr i64 LD = SPAN * BK;
  TilePart parts[SPAN];
  const T* vp[SPAN];
  int np = 0;                                              // tiles in the span so far
  auto flush = [&] {
    if (np == 0) return;
    rows_pass_lowp(a, it, parts, np, lb.s.get(), LD, false, buf, lb.p.get(), lb.mx.get());
    values_span_lowp(a, it, parts, np, vp, LD, buf, lb);
    np = 0;
  };
  for_each_tile(a, it, true, [&](i64 k0, i64 n, i64 npad, TileKind kind, const Sub* subs,
                                  int count) {
    if (np > 0 && (np == SPAN || parts[np - 1].k0 + BK != k0 || parts[np - 1].n != BK)) flush();
    const T* kt;
    i64 v_bad;
    packed_tile(a, kh, vh, it, k0, n, np, lb, kt, vp[np], v_bad);
    if (v_bad < round_up(n, 2)) {                          // inf/NaN in V: exact, on its own
      flush();
      scores_gemm_lowp(a, kt, it, subs, count, buf, lb);
      rows_pass_lowp(a, it, k0, n, npad, kind, true, buf, lb.p.get(), lb.mx.get());
      return values_axpy(a, vh, k0, n, a.G * it.nr, buf);
    }
    parts[np] = TilePart{k0, n, npad, kind, count, {}};
    std::copy(subs, subs + count, parts[np].subs);
    scores_gemm_lowp(a, kt, it, subs, count, lb.s.get() + np * BK, LD, lb);
    ++np;
  });
  flush();
}

// Rows of the item over its keys: acc, m, l in buf (R = G * nr rows). lb (T GEMMs, lowp.h)
// is null on the widening path. The GEMM loops ask for ahead's rows (the next item's), a
// share per tile.
template <typename A, typename T>
void attend_item(const Args<A>& a, const T* q, const T* k, const T* v, const Item& it,
                 Buffers<A>& buf, LowpBuffers<T>* lb, RowsAhead& ahead) {
  const i64 R = a.G * it.nr;
  const bool by_gemm = R >= 16;                            // brgemm pays off from 16 rows
  std::fill(buf.acc.begin(), buf.acc.begin() + R * a.DVP, A(0));
  std::fill(buf.m.begin(), buf.m.begin() + R, A(NEG_INF));
  std::fill(buf.l.begin(), buf.l.begin() + R, A(0));
  if (it.ke <= it.kb || it.nr <= 0) return;
  if constexpr (is_lowp<T>) {
    if (lb && by_gemm) return attend_item_lowp(a, q, k, v, it, buf, *lb);
  }
  gather_q(a, q, it, buf);
  const T* kh = k + it.b * a.sk[0] + it.kvh * a.sk[1];
  const T* vh = v + it.b * a.sv[0] + it.kvh * a.sv[1];
  const i64 tiles = (it.ke - it.kb / BK * BK + BK - 1) / BK;
  const i64 share = (ahead.lines + tiles * R - 1) / (tiles * R);  // lines per row of a tile
  for_each_tile(a, it, by_gemm, [&](i64 k0, i64 n, i64 npad, TileKind kind, const Sub* subs,
                                     int count) {
    screen_kv_rows(a, kh + k0 * a.sk[2], a.sk[2], vh + k0 * a.sv[2], a.sv[2], n);
    if (by_gemm) scores_gemm(a, kh, it, k0, n, subs, count, buf);
    else scores_dot(a, head_rows(a, kh, vh, k0), n, R, buf);
    rows_pass(a, it, k0, n, npad, kind, buf, by_gemm ? &ahead : nullptr, share);
    if (by_gemm) values_gemm(a, vh, it, k0, n, subs, count, buf);
    else values_axpy(a, vh, k0, n, R, buf);
  });
}

// out row (D_v,) = acc / l and lse = m + log l; l == 0 (no key) -> 0 and -inf.
template <typename A, typename O>
inline void finish_row(const A* acc, A m, A l, i64 Dv, O* out, A* lse) {
  if (l == A(0)) {
    for (i64 d = 0; d < Dv; ++d) out[d] = O(A(0));
    *lse = NEG_INF;
    return;
  }
  const A inv = A(1) / l;
  for (i64 d = 0; d < Dv; ++d) out[d] = O(acc[d] * inv);
  *lse = m + std::log(l);
}

// One row merged from C partials by log-sum-exp weights: partial c has LSE lses[c * ls] and
// output row outs + c * os (D_v,); an empty partial (LSE -inf) adds nothing, NaN in any
// partial's LSE gives NaN. accv: (D_v,) scratch.
template <typename A, typename O>
inline void merge_row(const A* lses, i64 ls, const A* outs, i64 os, i64 C, i64 Dv, A* accv,
                      O* orow, A* lse) {
  A M = NEG_INF;
  bool nan = false;
  for (i64 c = 0; c < C; ++c) {
    const A x = lses[c * ls];
    nan = nan || x != x;
    M = std::max(M, x);
  }
  std::fill(accv, accv + Dv, A(0));
  A s = 0;
  for (i64 c = 0; c < C; ++c) {                            // partial c's share
    const A x = lses[c * ls];
    if (x == NEG_INF || x != x) continue;
    const A w = std::exp(x - M);
    s += w;
    const A* o = outs + c * os;
    for (i64 d = 0; d < Dv; ++d) accv[d] += w * o[d];
  }
  if (nan) s = std::numeric_limits<A>::quiet_NaN();
  if (s == A(0)) {
    for (i64 d = 0; d < Dv; ++d) orow[d] = O(A(0));
    *lse = NEG_INF;
  } else {
    for (i64 d = 0; d < Dv; ++d) orow[d] = O(accv[d] / s);
    *lse = M + std::log(s);
  }
}

// Partials (B, H_q, N_q, C, D_v) / (B, H_q, N_q, C) -> out, lse by log-sum-exp weights.
template <typename A, typename O>
void merge_splits(const Args<A>& a, const A* po, const A* pl, O* out, A* lse) {
  const i64 C = a.splits, rows = a.B * a.Hq * a.Nq;
  at::parallel_for(0, rows, 16, [&](i64 begin, i64 end) {
    std::vector<A> accv(a.Dv);
    for (i64 r = begin; r < end; ++r)                      // r = flat (b, h, qi)
      merge_row(pl + r * C, 1, po + r * C * a.Dv, a.Dv, C, a.Dv, accv.data(), out + r * a.Dv,
                lse + r);
  });
}

// Work item t -> (b, kv head, query block (zig-zag), split): its rows and keys; q_end: the
// block's end (rows from q0 + nr on are past the batch's q_len).
template <typename A> Item item_of(const Args<A>& a, i64 t, i64& q_end) {
  const i64 C = a.splits, NQB = a.n_qblocks;
  const i64 c = t % C, zq = (t / C) % NQB, kvh = (t / (C * NQB)) % a.Hkv;
  const i64 b = t / (C * NQB * a.Hkv);
  // zig-zag over query blocks: contiguous thread ranges mix early (cheap, causal)
  // and late (dear) blocks
  const i64 qb = (zq % 2 == 0) ? zq / 2 : NQB - 1 - zq / 2;
  Item it{b, kvh, qb * a.rows, 0, 0, 0};
  q_end = std::min(a.Nq, it.q0 + a.rows);
  const i64 valid = a.q_len ? std::min(q_end, a.q_len[b * a.sql]) : q_end;
  it.nr = std::max<i64>(0, valid - it.q0);
  key_range(a, it, c * a.split_len, std::min(a.Nk, (c + 1) * a.split_len));
  return it;
}

// All items in parallel: item -> (b, kv head, query block (zig-zag), split).
template <typename A, typename T>
void run(const Args<A>& a, const T* q, const T* k, const T* v, T* out, A* lse) {
  const i64 C = a.splits, NQB = a.n_qblocks;
  const i64 n_items = a.B * a.Hkv * NQB * C;
  std::vector<A> po, pl;
  if (C > 1) {
    po.assign(a.B * a.Hq * a.Nq * C * a.Dv, A(0));
    pl.assign(a.B * a.Hq * a.Nq * C, A(NEG_INF));
  }
  at::parallel_for(0, n_items, 1, [&](i64 begin, i64 end) {
    Buffers<A> buf(a, a.G * a.rows);
    std::unique_ptr<LowpBuffers<T>> lb;                    // T GEMMs: packed K/V, Q, P in T
    if constexpr (is_lowp<T>)
      if (a.lowp) lb.reset(new LowpBuffers<T>(a, a.G * a.rows));
    RowsAhead ahead;
    i64 nx_end;
    Item nx = item_of(a, begin, nx_end);                   // the next item, found once
    for (i64 t = begin; t < end; ++t) {
      const i64 q_end = nx_end;
      const Item it = nx;
      if (t + 1 < end) {
        nx = item_of(a, t + 1, nx_end);
        rows_ahead(a, q, k, v, C == 1 ? out : nullptr, nx, buf, ahead);
      } else {
        ahead = RowsAhead{};
      }
      const i64 c = t % C, b = it.b, kvh = it.kvh;
      attend_item(a, q, k, v, it, buf, lb.get(), ahead);
      for (i64 g = 0; g < a.G; ++g)                        // rows [q0, q_end) of each head
        for (i64 i = 0; i < q_end - it.q0; ++i) {
          const i64 h = kvh * a.G + g, qi = it.q0 + i, r = g * it.nr + i;
          const bool ok = i < it.nr;
          const A* acc = buf.acc.data() + (ok ? r : 0) * a.DVP;
          const A m = ok ? buf.m[r] : A(NEG_INF), l = ok ? buf.l[r] : A(0);
          const i64 flat = (b * a.Hq + h) * a.Nq + qi;
          if (C == 1) {
            finish_row(acc, m, l, a.Dv, out + flat * a.Dv, lse + flat);
            if (a.out_bad && ok && !all_finite(out + flat * a.Dv, a.Dv))   // (in L1 now)
              a.out_bad->store(true, std::memory_order_relaxed);
          } else
            finish_row(acc, m, l, a.Dv, po.data() + (flat * C + c) * a.Dv, pl.data() + flat * C + c);
        }
    }
    if (lb && !a.lowp_emulate) at::native::cpublas::brgemm_release(true);  // AMX tile state
  });
  if (C > 1) merge_splits(a, po.data(), pl.data(), out, lse);
}

}  // namespace
}  // namespace attnkit_native
