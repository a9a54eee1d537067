// The backward pass, FlashAttention-2 style: P is recomputed from the saved LSE.
//
// A work item is (b, K/V head, key block [k0, k0 + n) of at most BK keys); it walks the
// rows of the G query heads that can see the block, BQ queries at a time:
//   S, P (nq, BK)  = Q K_blockᵀ -> fused score terms -> e^(x - lse)
//   dP   (nq, BK)  = dO V_blockᵀ          dS = P * (dP - delta) * d(capped)/d(score)
//   dV_block += Pᵀ dO    dK_block += dSᵀ Q    (accumulated in the item, no races)
//   dQ rows  += dS K_block                     (per-thread buffers in A, summed at the end)
//   d table[h, bucket] += dX  (dX = P * (dP - delta), the gradient of the score after the
//                              soft-cap; per-thread float64 (H_q, 2M+1), summed in thread order)
//   d slope[h] -= dX * |q + offset - k|   (when alibi_grad; per-thread float64 (H_q,) likewise)
//   d bias[b, h, q, k] = dX                (when bias_grad: each element is written by the one
//                                          item that owns its key block, so no races)
// delta = rowsum(dO * O) - dLSE (B, H_q, N_q). A key with P == 0 gives dS == 0 exactly, and
// K rows holding inf/NaN are zeroed for dQ, so NaN in masked K/V rows stays out.
// Everything is in the compute type A (float; double for float64 inputs), lse and delta too;
// for bfloat16 / float16 the five products may run in T instead (the low-precision section).
#pragma once
#include "common.h"
#include "lowp.h"

namespace attnkit_native {
namespace {

// Queries per backward tile: 128 on AVX-512 builds (one thread, float32 causal (1, 8, 2048,
// 64) forward + backward 174 -> 166 ms against 64; dense at 4096 and a 512-key window alike),
// 64 elsewhere (AVX2 CPUs such as Zen 3 have a quarter of the L2 for the tile's buffers: not
// measured there).
#if defined(__AVX512F__)
constexpr int BQ = 128;
#else
constexpr int BQ = 64;
#endif

// (rows: the tile's most queries, BQ, or BQL on the low-precision path)
template <typename A> struct BackBuffers {
  std::vector<A> kt, kb, vt, q, dout, s, dp, fac, pt, dk, dv, row;
  BackBuffers(const Args<A>& a, i64 rows)
      : kt(a.Dk * BK), kb(BK * a.DKP), vt(a.Dv * BK), q(BQ * a.DKP), dout(BQ * a.DVP),
        s(rows * BK), dp(rows * BK), fac(rows * BK), pt(BK * BQ), dk(BK * a.DKP),
        dv(BK * a.DVP), row(std::max(a.DKP, a.DVP)) {}
};

// kt (D_k, BK) = Kᵀ, kb (n, DKP) = K (non-finite rows zeroed), vt (D_v, BK) = Vᵀ of the block.
template <typename A, typename T>
void load_key_block(const Args<A>& a, const T* kh, const T* vh, i64 k0, i64 n,
                    BackBuffers<A>& bb) {
  A* row = bb.row.data();
  for (i64 j = 0; j < n; ++j) {
    row_to_compute(kh + (k0 + j) * a.sk[2], row, a.Dk, a.DKP);
    for (i64 d = 0; d < a.Dk; ++d) bb.kt[d * BK + j] = row[d];
    const bool finite = all_finite(row, a.Dk);
    for (i64 d = 0; d < a.DKP; ++d) bb.kb[j * a.DKP + d] = finite ? row[d] : A(0);
    row_to_compute(vh + (k0 + j) * a.sv[2], row, a.Dv, a.DVP);
    for (i64 d = 0; d < a.Dv; ++d) bb.vt[d * BK + j] = row[d];
  }
}

// P = e^(x - lse) <= 1: with huge logits lse = m + log l rounds at m's magnitude, and
// x - lse may come out a few ulps of m above 0 (e^that overflows); NaN stays NaN.
template <typename V> inline V prob(V x, V shift) {
  const V e = x - shift;
  return vexp_neg(select(e > 0, V{}, e));
}

// One row in place, (npad,): x -> P = e^(x - shift), dp -> dS = dX * d(capped)/d(score) with
// dX = P * (dP - delta), the factor being the scale (FacIsScale) or fac (per key); dX and dS
// are 0 where P is 0 (a masked key's dP and soft-cap factor may be NaN: NaN in its K / V
// row); with db, also db[0:n] = dX (fac is then the scratch).
template <bool FacIsScale, typename A>
inline void row_grads(A* x, A* dp, A* fac, i64 n, i64 npad, vec<A> scale, vec<A> shift,
                      vec<A> delta, A* db) {
  using V = vec<A>;
  const V zero = splat(A(0));
  for (i64 j = 0; j < npad; j += lanes<A>) {               // keys [j, j + L)
    const V p = prob(load(x + j), shift);
    store(x + j, p);
    const auto none = p == A(0);
    const V dx = select(none, zero, p * (load(dp + j) - delta));
    store(dp + j, select(none, zero, dx * (FacIsScale ? scale : load(fac + j))));
    if (db) store(fac + j, dx);
  }
  if (db) std::copy(fac, fac + n, db);
}

// P and dS of the tile's rows in place (bb.s: S -> P, bb.dp: dP -> dS, both (nq, BK)): the
// fused score terms, P = e^(x - lse), dX = P * (dP - delta), dS = dX * d(capped)/d(score);
// on the way the table's (dtab), the slopes' (dslope) and the bias's (a.dbias) gradients.
// Without softcap or score_mod, d(capped)/d(score) is the scale itself (no per-key factor).
template <typename A>
void tile_grads(const Args<A>& a, const A* lse, const A* delta, const Item& it, i64 h, i64 k0,
                i64 n, bool full, double* dtab, double* dslope, BackBuffers<A>& bb) {
  using V = vec<A>;
  constexpr int L = lanes<A>;
  const i64 nq = it.nr, npad = round_up(n, W);
  const bool fac_is_scale = !(a.softcap > A(0)) && !a.mod;
  const V sc = splat(a.scale);
  for (i64 i = 0; i < nq; ++i) {                           // P and dS, row by row
    const i64 qi = it.q0 + i, flat = (it.b * a.Hq + h) * a.Nq + qi;
    A *x = bb.s.data() + i * BK, *f = bb.fac.data() + i * BK, *dp = bb.dp.data() + i * BK;
    scale_and_cap(a, x, npad, fac_is_scale ? nullptr : f);
    apply_score_mod(a, x, f, n, it.b, h, qi, k0);
    position_terms_and_mask(a, x, n, npad, it.b, h, qi, k0, full);
    const V shift = splat(lse[flat] == NEG_INF ? A(0) : lse[flat]), dl = splat(delta[flat]);
    const V zero = splat(A(0));
    A* db = a.dbias ? a.dbias + flat * a.Nk + k0 : nullptr;  // (n,) this row's d bias
    if (!a.rel && !a.alibi_grad) {
      if (fac_is_scale) row_grads<true>(x, dp, f, n, npad, sc, shift, dl, db);
      else row_grads<false>(x, dp, f, n, npad, sc, shift, dl, db);
      continue;
    }
    // with the table: the same pass also sums dX over the two clamped buckets (lanes below
    // jl / from jh on) and keeps dX in f for the keys between, whose buckets differ; with
    // alibi_grad it sums dX * |qi + offset - k|
    i64 jl = 0, jh = 0;
    if (a.rel) rel_segments(a.rel_M, n, qi, k0, jl, jh);
    const V lane = iota<A>(), vjl = splat(A(jl)), vjh = splat(A(jh));
    const V dist0 = splat(A(qi - k0) + a.alibi_offset);
    V lo = zero, hi = zero, sl = zero;
    for (i64 j = 0; j < npad; j += L) {
      const V p = prob(load(x + j), shift);
      store(x + j, p);
      const auto none = p == A(0);
      const V dx = select(none, zero, p * (load(dp + j) - dl));       // 0 past n
      const V jv = lane + A(j);
      store(dp + j, select(none, zero, dx * (fac_is_scale ? sc : load(f + j))));
      if (a.rel || db) store(f + j, dx);
      if (a.rel) {
        lo += select(jv < vjl, dx, zero);
        hi += select(jv >= vjh, dx, zero);
      }
      if (a.alibi_grad) {
        sl += dx * vabs(dist0 - jv);
      }
    }
    if (a.alibi_grad) dslope[h] -= hsum(sl);
    if (db) std::copy(f, f + n, db);
    if (!a.rel) continue;
    double* dt = dtab + h * (2 * a.rel_M + 1);             // (2M+1,) this head's gradient
    dt[0] += hsum(lo);
    dt[2 * a.rel_M] += hsum(hi);
    const i64 off = k0 - qi + a.rel_M;                     // bucket of key j = off + j
    for (i64 j = jl; j < jh; ++j) dt[off + j] += f[j];
  }
}

// The tile's sub-blocks of the band (tile_subs), with S and dP zeroed on the rows a
// sub-block skips; returns their count.
template <typename A>
inline int band_subs(const Args<A>& a, const Item& it, i64 k0, i64 n, bool full, i64 nq,
                     BackBuffers<A>& bb, Sub (&subs)[BK / SUB]) {
  const int count = tile_subs(a, it, k0, n, full ? FULL : PARTIAL, subs);
  if (count > 1) {
    zero_skipped(subs, count, 1, nq, bb.s.data());
    zero_skipped(subs, count, 1, nq, bb.dp.data());
  }
  return count;
}

// One tile of nq queries [q0, q0 + nq) of head h against the loaded key block.
template <typename A, typename T>
void backward_tile(const Args<A>& a, const T* q, const T* dout, const i64* sdo, const A* lse,
                   const A* delta, const Item& it, i64 h, i64 k0, i64 n, bool full,
                   A* dq, double* dtab, double* dslope, BackBuffers<A>& bb) {
  using V = vec<A>;
  constexpr int L = lanes<A>;
  const i64 nq = it.nr, npad = round_up(n, W);
  const T* q0 = q + it.b * a.sq[0] + h * a.sq[1] + it.q0 * a.sq[2];   // the tile's first rows
  const T* do0 = dout + it.b * sdo[0] + h * sdo[1] + it.q0 * sdo[2];
  const A *qr, *dor;                                       // Q (nq, D_k), dO (nq, D_v) in A
  i64 ldq, ldo;
  // rows in A at a stride of at least their length (the GEMMs read D values a row: no
  // padding needed) are read as they are; other rows (e.g. dO broadcast, stride 0) converted
  bool direct = false;
  if constexpr (std::is_same_v<T, A>) direct = a.sq[2] >= a.Dk && sdo[2] >= a.Dv;
  if (direct) {
    qr = reinterpret_cast<const A*>(q0), ldq = a.sq[2];
    dor = reinterpret_cast<const A*>(do0), ldo = sdo[2];
  } else {
    for (i64 i = 0; i < nq; ++i) {                         // converted rows
      row_to_compute(q0 + i * a.sq[2], bb.q.data() + i * a.DKP, a.Dk, a.DKP);
      row_to_compute(do0 + i * sdo[2], bb.dout.data() + i * a.DVP, a.Dv, a.DVP);
    }
    qr = bb.q.data(), ldq = a.DKP, dor = bb.dout.data(), ldo = a.DVP;
  }
  // S, dP by the band's sub-blocks (rows a sub-block skips: S = dP = 0, masked below)
  Sub subs[BK / SUB];
  const int count = band_subs(a, it, k0, n, full, nq, bb, subs);
  for_each_block(subs, count, 1, nq, [&](i64 r0, i64 m, i64 j0, i64 nj) {
    gemm(m, nj, a.Dk, ldq, BK, BK, false, qr + r0 * ldq, bb.kt.data() + j0,
         bb.s.data() + r0 * BK + j0);
    gemm(m, nj, a.Dv, ldo, BK, BK, false, dor + r0 * ldo, bb.vt.data() + j0,
         bb.dp.data() + r0 * BK + j0);
  });
  tile_grads(a, lse, delta, it, h, k0, n, full, dtab, dslope, bb);
  // dV += Pᵀ dO, dK += dSᵀ Q, dQ += dS K, each over the sub-blocks' rows only (P = dS = 0
  // on the rows a sub-block skips)
  transpose(bb.s.data(), nq, n, BK, bb.pt.data(), BQ);     // Pᵀ (n, nq)
  for_each_block(subs, count, 1, nq, [&](i64 r0, i64 m, i64 j0, i64 nj) {
    gemm(nj, a.Dv, m, BQ, ldo, a.DVP, true, bb.pt.data() + j0 * BQ + r0, dor + r0 * ldo,
         bb.dv.data() + j0 * a.DVP);
  });
  transpose(bb.dp.data(), nq, n, BK, bb.pt.data(), BQ);    // dSᵀ (n, nq)
  A* dq_rows = dq + ((it.b * a.Hq + h) * a.Nq + it.q0) * a.DKP;
  for_each_block(subs, count, 1, nq, [&](i64 r0, i64 m, i64 j0, i64 nj) {
    gemm(nj, a.Dk, m, BQ, ldq, a.DKP, true, bb.pt.data() + j0 * BQ + r0, qr + r0 * ldq,
         bb.dk.data() + j0 * a.DKP);
    gemm(m, a.Dk, nj, BK, a.DKP, a.DKP, true, bb.dp.data() + r0 * BK + j0,
         bb.kb.data() + j0 * a.DKP, dq_rows + r0 * a.DKP);
  });
}

// ------------------------------------------------------------------ low-precision GEMMs
// The tile's low-precision GEMMs (bfloat16 / float16 inputs where lowp_path says T GEMMs
// run, lowp.h): the tile's five products in T with fp32 accumulation, P and dS rounded to T
// before the GEMMs that use them (as FlashAttention); the score terms, P from the saved LSE,
// delta and dS stay fp32 (tile_grads above).
//
// Per call, each query head's Q and dO in T, as rows and transposed (LowpQD):
//   qr (NQP, DKE)   dor (NQP, DVE)    A of S = Q Kᵀ and dP = dO Vᵀ (dims past D zero)
//   qt (D_k, NQP)   dot (D_v, NQP)    A of dKᵀ += Qᵀ dS and dVᵀ += dOᵀ P (queries past N_q 0)
// Per item (a key block of n keys), in the VNNI layout (lowp.h):
//   kt (DKE, BK), vt (DVE, BK): one block (DE / 2, BK, 2) each     Kᵀ, Vᵀ: B of S, dP
//   kp (BK, DKB): DKB / NB blocks (BK / 2, NB, 2)                K, rows holding inf/NaN 0
//                                                                (as the fp32 path's): B of dQ
//   dkt (D_k, BK), dvt (D_v, BK) fp32: dKᵀ, dVᵀ of the block, accumulated over its tiles
//   (rounded to T in dkt_t, dvt_t at the end)
// Per tile of nq <= BQL queries, from tile_grads' fp32 P and dS (nq, BK):
//   pp, dsp (BQL, BK): BK / NB blocks (BQL / 2, NB, 2)   P, dS by query pairs: B of dVᵀ, dKᵀ
//   dsr (BQL, BK)                                       dS rows in T: A of dQ
// dVᵀ and dKᵀ are computed transposed (dOᵀ P rather than Pᵀ dO) so that P and dS, not the
// inputs, are the packed operand: packed once per tile as they are rounded.
// The reduction over a sub-block's query rows [r0, r0 + m) runs over the even rows around
// it (pairs, as VNNI needs): P = dS = 0 on the rows a sub-block skips, and on the pad row.

constexpr int BQL = 128;  // queries per tile on this path (the K of the dKᵀ, dVᵀ GEMMs: AMX
                          // runs longer reductions faster; 64 measured ~10% slower, 256 no faster)

// Q and dO of every query head in T (see the legend). NQP: N_q rounded up to 64, plus 32
// (a transposed row 64 bytes more than a multiple of 128: rows 4 KiB apart would all fall in
// one of L1's sets, for the transpose's stores and the GEMMs' reads alike).
template <typename T> struct LowpQD {
  i64 NQP, DKE, DVE;
  AlignedArray<T> qr, qt, dor, dot;
};

// rows (NQP, DE) and transposed (D, NQP) of one head's rows src + i * ld (i < N, D values);
// transposed 32 rows at a time (each transposed row's 32 values: one cache line written).
template <typename T>
void rows_and_transposed(const T* src, i64 ld, i64 N, i64 D, i64 NQP, i64 DE, T* rows, T* t) {
  constexpr i64 R = 32;
  std::fill_n(rows, NQP * DE, T(0.f));
  std::fill_n(t, D * NQP, T(0.f));
  for (i64 i = 0; i < N; ++i) std::memcpy(rows + i * DE, src + i * ld, D * sizeof(T));
  for (i64 i0 = 0; i0 < N; i0 += R) {                      // rows [i0, i0 + r)
    const i64 r = std::min(R, N - i0);
    for (i64 d = 0; d < D; ++d)
      for (i64 i = 0; i < r; ++i) t[d * NQP + i0 + i] = rows[(i0 + i) * DE + d];
  }
}

template <typename A, typename T>
LowpQD<T> prepare_qd(const Args<A>& a, const T* q, const T* dout, const i64* sdo) {
  LowpQD<T> x{round_up(a.Nq, 64) + 32, round_up(a.Dk, 2), round_up(a.Dv, 2), {}, {}, {}, {}};
  const i64 heads = a.B * a.Hq;
  x.qr = aligned_array<T>(heads * x.NQP * x.DKE);
  x.qt = aligned_array<T>(heads * a.Dk * x.NQP);
  x.dor = aligned_array<T>(heads * x.NQP * x.DVE);
  x.dot = aligned_array<T>(heads * a.Dv * x.NQP);
  at::parallel_for(0, heads, 1, [&](i64 begin, i64 end) {
    for (i64 hh = begin; hh < end; ++hh) {                 // hh = b * H_q + h
      const i64 b = hh / a.Hq, h = hh % a.Hq;
      rows_and_transposed(q + b * a.sq[0] + h * a.sq[1], a.sq[2], a.Nq, a.Dk, x.NQP, x.DKE,
                          x.qr.get() + hh * x.NQP * x.DKE, x.qt.get() + hh * a.Dk * x.NQP);
      rows_and_transposed(dout + b * sdo[0] + h * sdo[1], sdo[2], a.Nq, a.Dv, x.NQP, x.DVE,
                          x.dor.get() + hh * x.NQP * x.DVE, x.dot.get() + hh * a.Dv * x.NQP);
    }
  });
  return x;
}

// One thread's packed key block, its fp32 dKᵀ / dVᵀ, and the tile's P and dS in T.
template <typename T> struct BackLowp {
  i64 DKE, DVE, DKB;
  bool onednn_pack, emulate;
  AlignedArray<T> kt, vt, kp, stage, pp, dsp, dsr, qtt, dott, dkt_t, dvt_t;
  avector<float> dkt, dvt;
  template <typename A> explicit BackLowp(const Args<A>& a)
      : DKE(round_up(a.Dk, 2)), DVE(round_up(a.Dv, 2)), DKB(round_up(a.Dk, NB)),
        onednn_pack(a.lowp_onednn_pack), emulate(a.lowp_emulate),
        kt(aligned_array<T>(DKE * BK)), vt(aligned_array<T>(DVE * BK)),
        kp(aligned_array<T>(BK * DKB)),
        stage(aligned_array<T>(BK * NB)),      // pack_rows of K rows: (BK, NB)
        pp(aligned_array<T>(BQL * BK)), dsp(aligned_array<T>(BQL * BK)),
        dsr(aligned_array<T>(BQL * BK)), qtt(aligned_array<T>(a.Dk * BQL)),
        dott(aligned_array<T>(a.Dv * BQL)), dkt_t(aligned_array<T>(a.Dk * BK)),
        dvt_t(aligned_array<T>(a.Dv * BK)), dkt(a.Dk * BK), dvt(a.Dv * BK) {}
};

// dkt_t, dvt_t (D, BK) <- the block's dKᵀ, dVᵀ rounded to T (then written out transposed).
template <typename A, typename T> void round_block_grads(const Args<A>& a, BackLowp<T>& lb) {
  for (i64 i = 0; i < a.Dk * BK; i += W) store_rounded(lb.dkt_t.get() + i, load(&lb.dkt[i]));
  for (i64 i = 0; i < a.Dv * BK; i += W) store_rounded(lb.dvt_t.get() + i, load(&lb.dvt[i]));
}

// The block's kt, vt, kp from K / V rows [k0, k0 + n) of one head; dKᵀ, dVᵀ zeroed.
template <typename A, typename T>
void load_key_block_lowp(const Args<A>& a, const T* kh, const T* vh, i64 k0, i64 n,
                         BackLowp<T>& lb) {
  const T* kr = kh + k0 * a.sk[2];
  const T* vr = vh + k0 * a.sv[2];
  pack_transposed_rows(kr, a.sk[2], n, a.Dk, lb.kt.get());
  pack_transposed_rows(vr, a.sv[2], n, a.Dv, lb.vt.get());
  pack_rows(kr, a.sk[2], n, BK, a.Dk, lb.kp.get(), lb.stage.get(), lb.onednn_pack, true);
  std::fill(lb.dkt.begin(), lb.dkt.end(), 0.f);
  std::fill(lb.dvt.begin(), lb.dvt.end(), 0.f);
}

// dst[0 : 2W] <- two rows' W values rounded to T, interleaved (x0[0], x1[0], x0[1], ...): one
// VNNI pair.
template <typename T> inline void store_pair(T* dst, vf x0, vf x1) {
  typedef uint32_t vu __attribute__((vector_size(W * 4)));
  if constexpr (std::is_same_v<T, at::BFloat16>) {         // bfloat16: a float's top half
    vu u0, u1;                                             // rounded as store_rounded does
    std::memcpy(&u0, &x0, sizeof u0);
    std::memcpy(&u1, &x1, sizeof u1);
    u0 = select(x0 != x0, vu{} + 0x7FC00000u, u0 + 0x7FFFu + ((u0 >> 16) & 1u));
    u1 = select(x1 != x1, vu{} + 0x7FC00000u, u1 + 0x7FFFu + ((u1 >> 16) & 1u));
    const vu w = (u0 >> 16) | (u1 & 0xFFFF0000u);
    std::memcpy(dst, &w, sizeof w);                        // little-endian: x0 first
  } else {
    typedef uint16_t vh __attribute__((vector_size(W * 2)));
    T r0[W], r1[W];
    store_rounded(r0, x0);
    store_rounded(r1, x1);
    vh h0, h1;
    std::memcpy(&h0, r0, sizeof h0);
    std::memcpy(&h1, r1, sizeof h1);
    const vu w = __builtin_convertvector(h0, vu) | (__builtin_convertvector(h1, vu) << 16);
    std::memcpy(dst, &w, sizeof w);
  }
}

// P, dS of the tile (fp32 (nq, BK) in p, ds; keys [0, npad)) rounded to T: pp and dsp by
// query pairs (the pad row past an odd nq 0), dsr as rows.
template <typename T>
void round_tile(const float* p, const float* ds, i64 nq, i64 npad, BackLowp<T>& lb) {
  const vf zero = splat(0.f);
  for (i64 i = 0; i < nq; i += 2) {                        // rows i, i + 1
    const bool two = i + 1 < nq;
    for (i64 j = 0; j < npad; j += W) {                    // keys [j, j + W)
      const i64 at = (j / NB) * (BQL * NB) + i * NB + (j % NB) * 2;  // pair i / 2, key j
      const vf p0 = load(p + i * BK + j), d0 = load(ds + i * BK + j);
      const vf p1 = two ? load(p + (i + 1) * BK + j) : zero;
      const vf d1 = two ? load(ds + (i + 1) * BK + j) : zero;
      store_pair(lb.pp.get() + at, p0, p1);
      store_pair(lb.dsp.get() + at, d0, d1);
      store_rounded(lb.dsr.get() + i * BK + j, d0);
      if (two) store_rounded(lb.dsr.get() + (i + 1) * BK + j, d1);
    }
  }
}

// The tile's columns [q0, q0 + nq) of a transposed operand xt (D, NQP) of N queries: xt
// itself (ld NQP), or — when nq is odd and a query (not the pad) follows the tile — a copy
// (D, BQL) in tile with the pad column 0, so the pair rounded out past the tile never reads
// that query (NaN there, e.g. a padded query's, would give 0 * NaN).
template <typename T>
inline const T* tile_columns(const T* xt, i64 D, i64 N, i64 NQP, i64 q0, i64 nq, T* tile,
                             i64& ld) {
  ld = NQP;
  if (nq % 2 == 0 || (q0 + nq >= N && q0 + nq < NQP)) return xt + q0;
  for (i64 d = 0; d < D; ++d) {                            // row d (nq + 1,)
    std::memcpy(tile + d * BQL, xt + d * NQP + q0, nq * sizeof(T));
    tile[d * BQL + nq] = T(0.f);
  }
  ld = BQL;
  return tile;
}

// C (M, BK) [:, j0 : j0 + nj] += A (M rows at ld lda, reduction columns [k0, k0 + kn)) .
// B rows [k0, k0 + kn), B (BQL, BK) packed by row pairs (pp / dsp); k0, kn even. One brgemm
// per VNNI block the columns touch.
template <typename T>
inline void transposed_grad_block(bool emulate, i64 M, const T* at, i64 lda, const T* bp,
                                  i64 k0, i64 kn, i64 j0, i64 nj, float* c) {
  for (i64 col = j0; col < j0 + nj;) {                     // columns [col, e) of one block
    const i64 blk = col / NB, e = std::min(j0 + nj, (blk + 1) * NB);
    lowp_brgemm(emulate, M, e - col, kn, lda, NB, BK, true, at + k0,
                bp + blk * (BQL * NB) + k0 * NB + (col - blk * NB) * 2, c + col);
    col = e;
  }
}

// One tile of nq queries [q0, q0 + nq) of head h against the packed key block.
template <typename A, typename T>
void backward_tile_lowp(const Args<A>& a, const LowpQD<T>& qd, const A* lse, const A* delta,
                        const Item& it, i64 h, i64 k0, i64 n, bool full, A* dq, double* dtab,
                        double* dslope, BackBuffers<A>& bb, BackLowp<T>& lb) {
  const i64 nq = it.nr, hh = it.b * a.Hq + h;
  const bool emu = lb.emulate;
  const T* qr = qd.qr.get() + (hh * qd.NQP + it.q0) * qd.DKE;   // (nq, DKE) this tile's rows
  const T* dor = qd.dor.get() + (hh * qd.NQP + it.q0) * qd.DVE;
  i64 ldq, ldo;                                                 // (D_k, nq), (D_v, nq)
  const T* qt = tile_columns(qd.qt.get() + hh * a.Dk * qd.NQP, a.Dk, a.Nq, qd.NQP, it.q0, nq,
                             lb.qtt.get(), ldq);
  const T* dot = tile_columns(qd.dot.get() + hh * a.Dv * qd.NQP, a.Dv, a.Nq, qd.NQP, it.q0, nq,
                              lb.dott.get(), ldo);
  // S, dP by the band's sub-blocks (rows a sub-block skips: S = dP = 0, masked below)
  Sub subs[BK / SUB];
  const int count = band_subs(a, it, k0, n, full, nq, bb, subs);
  for_each_block(subs, count, 1, nq, [&](i64 r0, i64 m, i64 j0, i64 nj) {
    scores_block_lowp(emu, qr, qd.DKE, lb.kt.get(), r0, m, j0, nj, bb.s.data());
    scores_block_lowp(emu, dor, qd.DVE, lb.vt.get(), r0, m, j0, nj, bb.dp.data());
  });
  tile_grads(a, lse, delta, it, h, k0, n, full, dtab, dslope, bb);
  round_tile(bb.s.data(), bb.dp.data(), nq, round_up(n, W), lb);
  // dVᵀ += dOᵀ P, dKᵀ += Qᵀ dS over the sub-blocks' rows rounded out to pairs (P = dS = 0
  // on the rows a sub-block skips and on the pad row), dQ += dS K
  A* dq_rows = dq + (hh * a.Nq + it.q0) * a.DKP;
  for_each_block(subs, count, 1, nq, [&](i64 r0, i64 m, i64 j0, i64 nj) {
    const i64 p0 = r0 / 2 * 2, pn = round_up(r0 + m, 2) - p0;
    transposed_grad_block(emu, a.Dv, dot, ldo, lb.pp.get(), p0, pn, j0, nj, lb.dvt.data());
    transposed_grad_block(emu, a.Dk, qt, ldq, lb.dsp.get(), p0, pn, j0, nj, lb.dkt.data());
    values_block_lowp(emu, lb.dsr.get(), lb.kp.get(), a.Dk, a.DKP, r0, m, j0, nj, dq_rows);
  });
}

// dq, dk, dv (contiguous, dtype T) of the whole call; dtab (H_q, 2M+1) in A when a.rel,
// dslope (H_q,) in A when a.alibi_grad.
template <typename A, typename T>
void run_backward(const Args<A>& a, const T* q, const T* k, const T* v, const T* dout,
                  const i64* sdo, const A* lse, const A* delta, T* dq, T* dk, T* dv,
                  A* dtab, A* dslope) {
  const i64 NKB = (a.Nk + BK - 1) / BK, n_items = a.B * a.Hkv * NKB;
  const int threads = std::max(1, at::get_num_threads());
  const i64 n_tab = a.rel ? a.Hq * (2 * a.rel_M + 1) : 0, n_sl = a.alibi_grad ? a.Hq : 0;
  std::vector<std::vector<A>> dq_t(threads);               // (B, H_q, N_q, DKP) per thread
  std::vector<std::vector<double>> dt_t(threads);          // (H_q, 2M+1) + (H_q,) per thread
  LowpQD<T> qd{};                                          // Q, dO in T: T GEMMs (lowp)
  if constexpr (is_lowp<T>)
    if (a.lowp) qd = prepare_qd(a, q, dout, sdo);
  at::parallel_for(0, n_items, 1, [&](i64 begin, i64 end) {
    const int tid = std::min(at::get_thread_num(), threads - 1);
    std::vector<A>& dqb = dq_t[tid];
    if (dqb.empty()) dqb.assign(a.B * a.Hq * a.Nq * a.DKP, A(0));
    std::vector<double>& dtb = dt_t[tid];
    if (dtb.empty()) dtb.assign(n_tab + n_sl + 1, 0.0);
    std::unique_ptr<BackLowp<T>> lb;
    if constexpr (is_lowp<T>)
      if (a.lowp) lb.reset(new BackLowp<T>(a));
    const i64 bq = lb ? BQL : BQ;                          // queries per tile
    BackBuffers<A> bb(a, bq);
    for (i64 t = begin; t < end; ++t) {
      const i64 kblk = t % NKB, kvh = (t / NKB) % a.Hkv, b = t / (NKB * a.Hkv);
      const i64 k0 = kblk * BK, kend = std::min(a.Nk, k0 + BK);
      const i64 kvl = a.kv_len ? std::min(kend, a.kv_len[b * a.skl]) : kend;
      const i64 n = std::max<i64>(0, kvl - k0);
      std::fill(bb.dk.begin(), bb.dk.end(), A(0));
      std::fill(bb.dv.begin(), bb.dv.end(), A(0));
      const T* kh = k + b * a.sk[0] + kvh * a.sk[1];
      const T* vh = v + b * a.sv[0] + kvh * a.sv[1];
      if constexpr (is_lowp<T>) {
        if (lb && n > 0) load_key_block_lowp(a, kh, vh, k0, n, *lb);
      }
      if (n > 0 && !lb) load_key_block(a, kh, vh, k0, n, bb);
      // queries that may see a key of the block: lo <= q - k <= hi
      const i64 nq_valid = a.q_len ? std::min(a.Nq, a.q_len[b * a.sql]) : a.Nq;
      const i64 qlo = i64(std::max(0.0, double(k0) + a.band_lo));
      const i64 qhi = i64(std::min(double(nq_valid), double(k0 + n - 1) + a.band_hi + 1.0));
      for (i64 g = 0; g < a.G && n > 0; ++g)
        for (i64 q0 = qlo; q0 < qhi; q0 += bq) {
          Item it{b, kvh, q0, std::min<i64>(bq, qhi - q0), k0, k0 + n};
          const TileKind kind = classify(a, it, k0, n);
          if (kind == EMPTY) continue;
          const i64 h = kvh * a.G + g;
          if constexpr (is_lowp<T>) {
            if (lb) {
              backward_tile_lowp(a, qd, lse, delta, it, h, k0, n, kind == FULL, dqb.data(),
                                 dtb.data(), dtb.data() + n_tab, bb, *lb);
              continue;
            }
          }
          backward_tile(a, q, dout, sdo, lse, delta, it, h, k0, n, kind == FULL, dqb.data(),
                        dtb.data(), dtb.data() + n_tab, bb);
        }
      if constexpr (is_lowp<T>)
        if (lb && n > 0) round_block_grads(a, *lb);
      for (i64 j = 0; j < kend - k0; ++j) {                // write the block (0 past kv_len)
        T* dkr = dk + ((b * a.Hkv + kvh) * a.Nk + k0 + j) * a.Dk;
        T* dvr = dv + ((b * a.Hkv + kvh) * a.Nk + k0 + j) * a.Dv;
        if (j >= n) {
          std::fill_n(dkr, a.Dk, T(A(0)));
          std::fill_n(dvr, a.Dv, T(A(0)));
        } else if (lb) {                                   // from dKᵀ, dVᵀ (D, BK) in T
          if constexpr (is_lowp<T>) {
            for (i64 d = 0; d < a.Dk; ++d) dkr[d] = lb->dkt_t[d * BK + j];
            for (i64 d = 0; d < a.Dv; ++d) dvr[d] = lb->dvt_t[d * BK + j];
          }
        } else {
          for (i64 d = 0; d < a.Dk; ++d) dkr[d] = T(bb.dk[j * a.DKP + d]);
          for (i64 d = 0; d < a.Dv; ++d) dvr[d] = T(bb.dv[j * a.DVP + d]);
        }
      }
    }
    if (lb && !a.lowp_emulate) at::native::cpublas::brgemm_release(true);  // AMX tile state
  });
  const i64 rows = a.B * a.Hq * a.Nq;                      // dq = sum of the thread buffers
  at::parallel_for(0, rows, 64, [&](i64 begin, i64 end) {
    for (i64 r = begin; r < end; ++r) {
      i64 d = 0;
      if constexpr (is_lowp<T>) {                          // W at a time, rounded in registers
        for (; d + W <= a.Dk; d += W) {
          vf s = splat(0.f);
          for (const auto& buf : dq_t)
            if (!buf.empty()) s += load(buf.data() + r * a.DKP + d);
          store_rounded(dq + r * a.Dk + d, s);
        }
      }
      for (; d < a.Dk; ++d) {
        A s = 0;
        for (const auto& buf : dq_t)
          if (!buf.empty()) s += buf[r * a.DKP + d];
        dq[r * a.Dk + d] = T(s);
      }
    }
  });
  for (i64 i = 0; i < n_tab + n_sl; ++i) {                 // thread order: deterministic
    double s = 0.0;
    for (const auto& buf : dt_t)
      if (!buf.empty()) s += buf[i];
    if (i < n_tab) dtab[i] = A(s); else dslope[i - n_tab] = A(s);
  }
}

}  // namespace
}  // namespace attnkit_native
