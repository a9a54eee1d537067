// Attention through a block table: K/V read from pages of a pool where they lie, no gathered
// copy (see attention.cpp for the forward's legend; serving.py for the calls that use this).
//
// Shape legend:
//   q        (total_q, H_q, D_k)    sequence s's queries: rows cu_q[s] .. cu_q[s+1] - 1
//   k_pool   (num_blocks, block_size, H_kv, D_k)    v_pool (num_blocks, block_size, H_kv, D_v)
//   table    (S, max_pages) int64   key t of sequence s: page table[s, t / block_size],
//                                   slot t % block_size
//   kv_len   (S,)  keys of sequence s        q_pos (S,)  position of s's first query, in key
//                                            coordinates (bottom-right: kv_len - n_q)
//   alibi    (S, H_q) slopes or none
//   out      (total_q, H_q, D_v) q's dtype   lse (total_q, H_q) in A (-inf: no key)
// Query i of sequence s sits at position p = q_pos[s] + i and sees key t when
// band_lo <= p - t <= band_hi and t < kv_len[s]; ALiBi adds -slope * |p - t|.
//
// A work item is (sequence, K/V head, query block, key split): the forward's Item with its
// query positions absolute (q0 = q_pos + first query), so the closed-form band, the tile
// walk and the fused row pass of forward.h run on it unchanged. Per key tile (BK keys on
// the sequence's grid) the K/V row addresses come from the block table (rows_of_tile);
// the dot loops (few rows: decode) read those rows as they lie, in T; the GEMM path (16
// rows or more: chunks, shared prefixes) transposes K and converts V per tile into the
// thread's buffers — or, bfloat16 / float16 where lowp.h's GEMMs run, packs them in T in
// the VNNI layout from the listed rows and multiplies in T (gemm_tile_pass_lowp). A long
// sequence is split into several items (each about 1/8 of a thread's share of the keys),
// which the threads take one at a time, so one long sequence does not leave a core idle; a
// sequence's splits are merged by LSE.
// On the dot loops the H_kv items of one (sequence, query block, split) are one task, run
// tile by tile with every head's rows of a tile read before the next tile: a page holds a
// token's heads side by side (slot stride H_kv * D), so one head alone reads D of every
// H_kv * D elements (a strided walk: fp32 decode took 2.2x the CPU time of the same keys
// stored head by head), while all heads together read the page's tokens whole. With GQA
// (R = G * queries in 2 .. 8 rows per K/V head, float compute) a tile runs on the GQA loops
// (group_tile): each K and V row is converted in registers once for all R rows, keys taken
// key-major across the heads (the pages read front to back) — except bfloat16 where the CPU
// has AVX512-BF16, which runs forward.h's bf16 dot loops head by head (on_group_loop).
#pragma once
#include <atomic>
#include <torch/library.h>

#include "forward.h"

namespace attnkit_native {
namespace {

// The pools and the block table.
template <typename T> struct Pages {
  const T* k; const T* v;
  i64 block_size, num_blocks;
  i64 sk[3], sv[3];                 // strides (block, slot, head) of k / v; last dim is 1
  const i64* table; i64 st[2];      // (S, max_pages)
};

// One sequence of the call and where its items and partials are.
struct PagedSeq {
  i64 q_first, nq, nk, pos;         // rows [q_first, + nq) of q; keys [0, nk); q position
  i64 rows, nqb, splits;            // queries per item, query blocks, key splits
  i64 part0;                        // first partial slot (splits > 1), else -1
};

// One work item: sequence s, K/V head, query block, split, and its rows and keys.
struct PagedItem {
  i64 s, kvh, qb, c;
  Item it;                          // absolute query positions, key range [kb, ke)
};

constexpr i64 TILE_PTRS = BK + AHEAD;  // a tile's rows and the ones prefetched after it

// krow[j], vrow[j] <- the K/V rows (head kvh) of keys k0 + j of sequence s, j in [0, n).
template <typename T>
void rows_of_tile(const Pages<T>& pg, i64 s, i64 kvh, i64 k0, i64 n, const T** krow,
                  const T** vrow) {
  const i64* tab = pg.table + s * pg.st[0];
  for (i64 j = 0; j < n;) {                                // one page run at a time
    const i64 t = k0 + j, p = t / pg.block_size, slot = t - p * pg.block_size;
    const i64 page = tab[p * pg.st[1]];
    const T* kp = pg.k + page * pg.sk[0] + kvh * pg.sk[2];
    const T* vp = pg.v + page * pg.sv[0] + kvh * pg.sv[2];
    const i64 run = std::min(n - j, pg.block_size - slot);
    for (i64 u = 0; u < run; ++u) {
      krow[j + u] = kp + (slot + u) * pg.sk[1];
      vrow[j + u] = vp + (slot + u) * pg.sv[1];
    }
    j += run;
  }
}

// A tile's K/V rows as rows_of_tile lists them: the dot loops' Rows (forward.h).
// ahead_bf16: twice the strided heads' distance (forward.h's AHEAD_BF16), as far as a tile's
// listed rows reach past it (TILE_PTRS): one head's listed rows jump to a page elsewhere in
// the pool every block_size rows, where the hardware prefetchers lose the stream (forward.h's
// heads, one fixed stride: 8 stays best there). The bench's decode step
// (16 sequences of 1016-7005 keys, GQA 32/8, D=128, bf16, block_size 16), one thread:
// 28.3 -> 26.8 ms thread CPU time (medians of 7 alternating processes, shared host).
template <typename T> struct ListedRows {
  const T* const* kr; const T* const* vr;
  i64 end;                          // rows listed
  static constexpr i64 ahead_bf16 = 2 * AHEAD_BF16;
  const T* k(i64 j) const { return kr[j]; }
  const T* v(i64 j) const { return vr[j]; }
};

// Eight floats at p, converted in registers (the 8 x 8 transpose's loads; v8f: lowp.h).
inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline v8f load8(const at::BFloat16* p) {                 // bfloat16 = a float's top half
#if defined(__AVX2__)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (v8f)_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);   // as common.h's load_vec
#else
  typedef uint16_t v8h __attribute__((vector_size(16)));
  typedef uint32_t v8u __attribute__((vector_size(32)));
  v8h h;
  std::memcpy(&h, p, sizeof h);
  return (v8f)(__builtin_convertvector(h, v8u) << 16);
#endif
}
inline v8f load8(const at::Half* p) {
#if defined(__F16C__)
  return (v8f)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  v8f v;
  for (int i = 0; i < 8; ++i) v[i] = float(p[i]);
  return v;
#endif
}

// kt (D_k, BK) <- the n rows krow transposed, in A: float by 8 x 8 blocks in registers
// (converted as loaded); the edges (and double) through t8 (8, D_k), eight rows converted
// at a time, then written eight keys per d. K rows AHEAD on (up to n_ptr) and the block's
// V rows (vrow, when given) are prefetched: the first read of the keys is a DRAM miss.
template <typename A, typename T>
void transpose_rows(const Args<A>& a, const T* const* krow, i64 n, A* kt, A* t8,
                    const T* const* vrow = nullptr, i64 n_ptr = 0) {
  for (i64 j0 = 0; j0 < n; j0 += 8) {
    const i64 m = std::min<i64>(8, n - j0);
    for (i64 u = 0; u < 8; ++u) {
      if (j0 + u + AHEAD < n_ptr) prefetch_row(krow[j0 + u + AHEAD], a.Dk);
      if (vrow && u < m) prefetch_row(vrow[j0 + u], a.Dv);
    }
    i64 d0 = 0;
    if constexpr (std::is_same_v<A, float>) {
      if (m == 8)
        for (; d0 + 8 <= a.Dk; d0 += 8) {
          v8f r[8];
          for (int u = 0; u < 8; ++u) r[u] = load8(krow[j0 + u] + d0);
          transpose8_store(r, kt + d0 * BK + j0, BK);
        }
    }
    if (d0 == a.Dk) continue;
    for (i64 u = 0; u < 8; ++u) {                          // t8 (8, D_k): rows j0 .. j0 + 7
      if (u < m) row_to_compute(krow[j0 + u], t8 + u * a.Dk, a.Dk, a.Dk);
      else std::fill_n(t8 + u * a.Dk, a.Dk, A(0));
    }
    for (i64 d = d0; d < a.Dk; ++d) {
      A* dst = kt + d * BK + j0;
      for (int u = 0; u < 8; ++u) dst[u] = t8[u * a.Dk + d];
    }
  }
}

// dst (n, DVP) <- the n rows src[j] (D_v,) in A, zero-padded; returns whether they are all
// finite (x * 0 is NaN exactly at inf/NaN), checked lane-wise as converted: one pass over
// the rows, not a second over the tile (two sums: one chain of adds is latency-bound).
template <typename A, typename T>
bool rows_to_compute_finite(const T* const* src, i64 n, i64 Dv, i64 DVP, A* dst) {
  using V = vec<A>;
  constexpr i64 L = lanes<A>;
  V z0 = splat(A(0)), z1 = z0;
  A t = A(0);
  for (i64 j = 0; j < n; ++j) {                            // row j: (D_v,) -> (DVP,)
    const T* s = src[j];
    A* d = dst + j * DVP;
    i64 i = 0;
    for (; i + 2 * L <= Dv; i += 2 * L) {
      const V x = load_vec(s + i), y = load_vec(s + i + L);
      store(d + i, x);
      store(d + i + L, y);
      z0 += x * A(0);
      z1 += y * A(0);
    }
    for (; i < Dv; ++i) {
      d[i] = A(s[i]);
      t += d[i] * A(0);
    }
    for (; i < DVP; ++i) d[i] = A(0);
  }
  return hsum(z0 + z1) + t == A(0);
}

// A thread's converted tiles of one (sequence, K/V head), for the GEMM loop: Kᵀ (D_k, BK)
// and V (BK, DVP) per tile of BK keys, converted once and reused by every query block of
// that head (a prefill chunk's blocks all read the same keys). Used when every thread's
// copy fits in 64 MB (Args::cache_kt), else a tile is converted per use.
template <typename A> struct TileCache {
  std::unique_ptr<A[]> kt, v;
  std::vector<char> state;          // per tile: 0 = not yet, 1 = finite V, 2 = V has inf/NaN
  i64 s = -1, h = -1;
};

// A thread's buffers on the paged loops.
template <typename A, typename T> struct PagedBuffers {
  std::vector<const T*> krow, vrow;                        // (H_kv, TILE_PTRS) row addresses
  std::vector<A> t8;                                       // (8, D_k) rows being transposed
  TileCache<A> cache;
  i64 tiles;                                               // tiles a cache holds
  std::vector<Buffers<A>> heads;                           // a dot task's buffers, per head
  PagedBuffers(const Args<A>& a, i64 max_tiles)
      : krow(a.Hkv * TILE_PTRS), vrow(a.Hkv * TILE_PTRS), t8(8 * a.Dk), tiles(max_tiles) {}
  ListedRows<T> rows(i64 h, i64 end) const {               // head h's listed rows
    return {krow.data() + h * TILE_PTRS, vrow.data() + h * TILE_PTRS, end};
  }
};

// The tile [k0, k0 + n) of the item on the GEMM loop: Kᵀ and V converted (from the thread's
// cache when on, filled there on first use with all the tile's keys), and whether V is
// finite; krow / vrow hold the rows of keys [k0, k0 + filled).
template <typename A, typename T>
void gemm_tile(const Args<A>& a, const Pages<T>& pg, const PagedSeq& seq, const PagedItem& pi,
               i64 k0, i64 n, Buffers<A>& buf, PagedBuffers<A, T>& pb, const A*& kt,
               const A*& vt, bool& finite, i64& filled) {
  const i64 n_ptr = std::min(TILE_PTRS, pi.it.ke - k0);
  if (!a.cache_kt) {
    rows_of_tile(pg, pi.s, pi.kvh, k0, n_ptr, pb.krow.data(), pb.vrow.data());
    filled = n_ptr;
    A* k_buf = buf.kt_buffer(a);
    transpose_rows(a, pb.krow.data(), n, k_buf, pb.t8.data(), pb.vrow.data(), n_ptr);
    kt = k_buf;
    vt = buf.v.data();
    finite = rows_to_compute_finite(pb.vrow.data(), n, a.Dv, a.DVP, buf.v.data());
    return;
  }
  TileCache<A>& c = pb.cache;
  if (!c.kt) {
    c.kt.reset(new A[pb.tiles * a.Dk * BK]);
    c.v.reset(new A[pb.tiles * BK * a.DVP]);
    c.state.assign(pb.tiles, 0);
  }
  if (c.s != pi.s || c.h != pi.kvh) {
    std::fill(c.state.begin(), c.state.end(), 0);
    c.s = pi.s;
    c.h = pi.kvh;
  }
  const i64 t = k0 / BK, n_all = std::min<i64>(BK, seq.nk - k0);  // the tile's keys
  filled = std::max(n_ptr, n_all);
  rows_of_tile(pg, pi.s, pi.kvh, k0, filled, pb.krow.data(), pb.vrow.data());
  A* kt_t = c.kt.get() + t * a.Dk * BK;
  A* v_t = c.v.get() + t * BK * a.DVP;
  if (!c.state[t]) {
    transpose_rows(a, pb.krow.data(), n_all, kt_t, pb.t8.data(), pb.vrow.data(), filled);
    c.state[t] = rows_to_compute_finite(pb.vrow.data(), n_all, a.Dv, a.DVP, v_t) ? 1 : 2;
  }
  kt = kt_t;
  vt = v_t;
  finite = c.state[t] == 1;     // (a NaN past the item's keys only costs the exact path)
}

// The tile on the GEMM loop: S <- Qs . Kᵀ, the row pass, acc += P . V (by the tile's
// sub-blocks); a tile whose V holds inf/NaN takes the P == 0-skipping path for P . V.
template <typename A, typename T>
void gemm_tile_pass(const Args<A>& a, const Pages<T>& pg, const PagedSeq& seq,
                    const PagedItem& pi, i64 k0, i64 n, i64 npad, TileKind kind,
                    const Sub* subs, int count, Buffers<A>& buf, PagedBuffers<A, T>& pb) {
  const Item& it = pi.it;
  const A *kt, *vt;
  bool finite;
  i64 filled;
  gemm_tile(a, pg, seq, pi, k0, n, buf, pb, kt, vt, finite, filled);
  if (count > 1) zero_skipped(subs, count, a.G, it.nr, buf.s.data());
  for_each_block(subs, count, a.G, it.nr, [&](i64 r0, i64 m, i64 j0, i64 nj) {
    gemm(m, nj, a.Dk, a.DKP, BK, BK, false, buf.q.data() + r0 * a.DKP, kt + j0,
         buf.s.data() + r0 * BK + j0);
  });
  rows_pass(a, it, k0, n, npad, kind, buf);
  if (!finite) return values_axpy(a, pb.rows(0, filled), n, a.G * it.nr, buf);
  for_each_block(subs, count, a.G, it.nr, [&](i64 r0, i64 m, i64 j0, i64 nj) {
    gemm(m, a.Dv, nj, BK, a.DVP, a.DVP, true, buf.s.data() + r0 * BK + j0, vt + j0 * a.DVP,
         buf.acc.data() + r0 * a.DVP);
  });
}

// Qs (R, DKP) <- the item's query rows (token q_first + qb * rows + i, head kvh * G + g).
template <typename A, typename T>
void gather_q_packed(const Args<A>& a, const T* q, const i64 (&sq)[2], const PagedSeq& sq_,
                     const PagedItem& pi, Buffers<A>& buf) {
  for (i64 g = 0; g < a.G; ++g)
    for (i64 i = 0; i < pi.it.nr; ++i) {
      const i64 tok = sq_.q_first + pi.qb * sq_.rows + i;
      const T* src = q + tok * sq[0] + (pi.kvh * a.G + g) * sq[1];
      row_to_compute(src, buf.q.data() + (g * pi.it.nr + i) * a.DKP, a.Dk, a.DKP);
    }
}

// Whether an item runs on the dot loops: fewer than 16 rows (brgemm pays off from 16).
template <typename A> inline bool on_dot_loop(const Args<A>& a, const Item& it) {
  return a.G * it.nr < 16;
}

// acc, m, l of R rows <- empty (no key yet).
template <typename A> inline void clear_rows(const Args<A>& a, i64 R, Buffers<A>& buf) {
  std::fill(buf.acc.begin(), buf.acc.begin() + R * a.DVP, A(0));
  std::fill(buf.m.begin(), buf.m.begin() + R, A(NEG_INF));
  std::fill(buf.l.begin(), buf.l.begin() + R, A(0));
}

// ---- the GEMM loop in T (bfloat16 / float16 GEMMs, lowp.h; Args::lowp): Q rows and P in
// T, each tile's Kᵀ and V packed in the VNNI layout from the rows the block table lists
// (lowp.h pack_kt_rows / pack_v_rows), S, the score terms and the softmax in float.

// Q (R, DKE) in T <- the item's query rows (token q_first + qb * rows + i, head kvh * G + g),
// zero padded.
template <typename A, typename T>
void gather_q_lowp(const Args<A>& a, const T* q, const i64 (&sq)[2], const PagedSeq& seq,
                   const PagedItem& pi, LowpBuffers<T>& lb) {
  for (i64 g = 0; g < a.G; ++g)
    for (i64 i = 0; i < pi.it.nr; ++i) {                   // row g * nr + i (DKE,)
      const i64 tok = seq.q_first + pi.qb * seq.rows + i;
      q_row_lowp(q + tok * sq[0] + (pi.kvh * a.G + g) * sq[1], a.Dk, lb.DKE,
                 lb.q.get() + (g * pi.it.nr + i) * lb.DKE);
    }
}

// The tile [k0, k0 + n) of the item packed (from the thread's cache of this (sequence, K/V
// head) when on, packed there on first use with all the tile's keys), and V's first row
// holding inf/NaN; krow / vrow hold the rows of keys [k0, k0 + n).
template <typename A, typename T>
void packed_paged_tile(const Pages<T>& pg, const Args<A>& a, const PagedSeq& seq,
                       const PagedItem& pi, i64 k0, i64 n, PagedBuffers<A, T>& pb,
                       LowpBuffers<T>& lb, const T*& kt, const T*& vt, i64& v_bad) {
  i64 t = 0, len = n;
  if (lb.cache) {                                          // k0 is a multiple of BK here
    t = lb.slot(pi.s, pi.kvh, k0);
    len = std::min<i64>(BK, seq.nk - k0);                  // the whole tile, for every item
  }
  rows_of_tile(pg, pi.s, pi.kvh, k0, std::max(n, len), pb.krow.data(), pb.vrow.data());
  T* ktt = lb.kt.get() + t * lb.kt_tile;
  T* vtt = lb.v_at(t);
  if (!lb.cache || !lb.done[t]) {
    pack_kt_rows(a.Dk, pb.krow.data(), len, ktt);
    lb.v_bad[t] = pack_v_rows(a.Dv, pb.vrow.data(), len, vtt, lb.vps);
    lb.done[t] = 1;
  }
  kt = ktt;
  vt = vtt;
  v_bad = lb.v_bad[t];
}

// The tile on the GEMM loop in T: S <- Q . Kᵀ, the row pass (P also rounded to T), acc +=
// P . V (by the tile's sub-blocks); a tile whose V rows read hold inf/NaN takes the P ==
// 0-skipping path for P . V (in float, on the listed rows).
template <typename A, typename T>
void gemm_tile_pass_lowp(const Args<A>& a, const Pages<T>& pg, const PagedSeq& seq,
                         const PagedItem& pi, i64 k0, i64 n, i64 npad, TileKind kind,
                         const Sub* subs, int count, Buffers<A>& buf, PagedBuffers<A, T>& pb,
                         LowpBuffers<T>& lb) {
  const Item& it = pi.it;
  const T *kt, *vt;
  i64 v_bad;
  packed_paged_tile(pg, a, seq, pi, k0, n, pb, lb, kt, vt, v_bad);
  scores_gemm_lowp(a, kt, it, subs, count, buf, lb);
  const bool bad_v = v_bad < round_up(n, 2);               // (then the float P is kept)
  rows_pass_lowp(a, it, k0, n, npad, kind, bad_v, buf, lb.p.get(), lb.mx.get());
  if (bad_v) return values_axpy(a, pb.rows(0, n), n, a.G * it.nr, buf);
  for_each_block(subs, count, a.G, it.nr, [&](i64 r0, i64 m, i64 j0, i64 nj) {
    values_block_lowp(a.lowp_emulate, lb.p.get(), vt, a.Dv, a.DVP, r0, m, j0, nj,
                      buf.acc.data(), BK, lb.vps);
  });
}

// One item over its keys on the GEMM loop: acc, m, l in buf (R = G * nr rows); lb (T GEMMs)
// is null on the widening path.
template <typename A, typename T>
void attend_paged_item(const Args<A>& a, const Pages<T>& pg, const T* q, const i64 (&sq)[2],
                       const PagedSeq& seq, const PagedItem& pi, Buffers<A>& buf,
                       PagedBuffers<A, T>& pb, LowpBuffers<T>* lb) {
  const Item& it = pi.it;
  clear_rows(a, a.G * it.nr, buf);
  if (it.ke <= it.kb || it.nr <= 0) return;
  if constexpr (is_lowp<T>) {
    if (lb) {
      gather_q_lowp(a, q, sq, seq, pi, *lb);
      return for_each_tile(a, it, true, [&](i64 k0, i64 n, i64 npad, TileKind kind,
                                             const Sub* subs, int count) {
        gemm_tile_pass_lowp(a, pg, seq, pi, k0, n, npad, kind, subs, count, buf, pb, *lb);
      });
    }
  }
  gather_q_packed(a, q, sq, seq, pi, buf);
  for_each_tile(a, it, true, [&](i64 k0, i64 n, i64 npad, TileKind kind, const Sub* subs,
                                  int count) {
    gemm_tile_pass(a, pg, seq, pi, k0, n, npad, kind, subs, count, buf, pb);
  });
}

// ---- GQA on the dot loops: the R = G * nr query rows of a K/V head (decode: its G query
// heads) read each K and V row once, converted in registers, for all R rows at once (the
// generic loops convert a low-precision row into a buffer, then read it back R times).

// Whether the GQA loops read bf16 K rows as pairs (AVX2 and AVX-512 builds, D_k on whole
// 2Ws): a load of 2W bf16 is W floats of the even d (<< 16) and W of the odd d
// (& 0xffff0000), no widening; q then lies split (split_q). (The portable build converts as
// before; AVX512-BF16 runs forward.h's loops instead, on_group_loop.)
template <typename T> inline bool k_pairs(const Args<float>& a) {
#if defined(__AVX2__)
  return std::is_same_v<T, at::BFloat16> && a.Dk % (2 * W) == 0;
#else
  (void)a;
  return false;
#endif
}

// Qs (R, DKP) in place <- each 2W-block of d as its even d, then its odd d (k_pairs' order).
inline void split_q(const Args<float>& a, i64 R, Buffers<float>& buf) {
  for (i64 r = 0; r < R; ++r)
    for (i64 d = 0; d + 2 * W <= a.Dk; d += 2 * W) {       // block (2W,) -> (W even, W odd)
      float* q = buf.q.data() + r * a.DKP + d;
      float t[2 * W];
      std::copy_n(q, 2 * W, t);
      for (int i = 0; i < W; ++i) {
        q[i] = t[2 * i];
        q[W + i] = t[2 * i + 1];
      }
    }
}

#if defined(__AVX2__)
// The 2W bf16 at p as W floats of the even d (x << 16) and W of the odd d (x & 0xffff0000),
// exact, from one load (k_pairs).
inline void pairs_of(const at::BFloat16* p, vf& even, vf& odd) {
#if defined(__AVX512F__)
  __m512 e, o;
  bf16_pairs(_mm512_loadu_si512(p), e, o);
#else
  __m256 e, o;
  bf16_pairs(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), e, o);
#endif
  even = (vf)e;
  odd = (vf)o;
}
#endif

// s[r][u] += q_r . k_u over D_k (R * KEYS accumulators): K rows widened to float as loaded,
// or, PAIRS (k_pairs; q split), read 2W bf16 at a time as their even and odd d.
template <int R, int KEYS, bool PAIRS, typename T>
inline void dots_acc(const Args<float>& a, const float* q, const T* const (&kr)[KEYS],
                     vf (&s)[R][KEYS]) {
#if defined(__AVX2__)
  if constexpr (PAIRS && std::is_same_v<T, at::BFloat16>) {
    for (i64 d = 0; d < a.Dk; d += 2 * W) {                // (R, 2W) . (2W, KEYS)
      vf ke[KEYS], ko[KEYS];
      for (int u = 0; u < KEYS; ++u) pairs_of(kr[u] + d, ke[u], ko[u]);
      for (int r = 0; r < R; ++r) {
        const vf qe = load(q + r * a.DKP + d), qo = load(q + r * a.DKP + d + W);
        for (int u = 0; u < KEYS; ++u) {
          s[r][u] += qe * ke[u];
          s[r][u] += qo * ko[u];
        }
      }
    }
    return;
  }
#endif
  for (i64 d = 0; d < a.Dk; d += W) {                      // (R, W) . (W, KEYS)
    vf k[KEYS];
    for (int u = 0; u < KEYS; ++u) k[u] = load_vec(kr[u] + d);
    for (int r = 0; r < R; ++r) {
      const vf qd = load(q + r * a.DKP + d);
      for (int u = 0; u < KEYS; ++u) s[r][u] += qd * k[u];
    }
  }
}

// S[r, j + u] (rows R, stride BK) <- q_r . k_{j+u} for KEYS keys: R * KEYS accumulators.
template <int R, int KEYS, bool PAIRS, typename T>
inline void dots_group(const Args<float>& a, const ListedRows<T>& rows, i64 j,
                       Buffers<float>& buf) {
  const float* q = buf.q.data();
  const T* kr[KEYS];
  for (int u = 0; u < KEYS; ++u) {
    if (j + u + AHEAD < rows.end) prefetch_row(rows.k(j + u + AHEAD), a.Dk);
    prefetch_row(rows.v(j + u), a.Dv);                     // this tile's V, used next
    kr[u] = rows.k(j + u);
  }
  vf s[R][KEYS];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < KEYS; ++u) s[r][u] = splat(0.f);
  dots_acc<R, KEYS, PAIRS>(a, q, kr, s);
#if defined(__AVX2__) && !defined(__AVX512F__)
  if constexpr (R * KEYS == 8) {                           // the 8 sums at once (hadd tree)
    const vf* f = &s[0][0];                                // row-major: f[r * KEYS + u]
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps((__m256)f[0], (__m256)f[1]),
                                     _mm256_hadd_ps((__m256)f[2], (__m256)f[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps((__m256)f[4], (__m256)f[5]),
                                     _mm256_hadd_ps((__m256)f[6], (__m256)f[7]));
    float sums[8];
    _mm256_storeu_ps(sums, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                                         _mm256_permute2f128_ps(u0, u1, 0x31)));
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < KEYS; ++u) buf.s[r * BK + j + u] = sums[r * KEYS + u];
    return;
  }
#endif
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < KEYS; ++u) buf.s[r * BK + j + u] = hsum(s[r][u]);
}

// x in every lane (one vbroadcastss from memory; splat's 0 + x costs an add before it, and
// a lane-by-lane fill was compiled as up to 9 inserts per row).
inline vf bcast(const float* x) {
#if defined(__AVX512F__)
  return (vf)_mm512_set1_ps(*x);
#elif defined(__AVX__)
  return (vf)_mm256_broadcast_ss(x);
#else
  vf v;
  for (int i = 0; i < W; ++i) v[i] = *x;
  return v;
#endif
}

// acc[:, d : d + DC * W) (R rows) += P[:, j0 : j1) . V rows j0 .. j1 - 1 (those columns):
// the R * DC accumulators held in registers over the keys.
template <int R, int DC, typename T>
inline void values_cols(const Args<float>& a, const ListedRows<T>& rows, i64 j0, i64 j1,
                        i64 d, Buffers<float>& buf) {
  float* acc = buf.acc.data();
  const float* p = buf.s.data();
  vf o[R][DC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < DC; ++c) o[r][c] = load(acc + r * a.DVP + d + c * W);
  for (i64 j = j0; j < j1; ++j) {
    const T* vr = rows.v(j) + d;
    vf v[DC];
    for (int c = 0; c < DC; ++c) v[c] = load_vec(vr + c * W);
    for (int r = 0; r < R; ++r) {
      const vf pr = bcast(p + r * BK + j);
      for (int c = 0; c < DC; ++c) o[r][c] += pr * v[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < DC; ++c) store(acc + r * a.DVP + d + c * W, o[r][c]);
}

// acc (R, D_v) += P (R, [j0, j1)) . V rows j0 .. j1 - 1 (a few keys: their rows stay in L1),
// DC vectors of d at a time (R * DC <= 8 accumulators), the rest one vector at a time.
// Every P must be nonzero (a P == 0 key's V row is not to be read: NaN in masked V; see
// values_group_ok).
template <int R, typename T>
void values_group(const Args<float>& a, const ListedRows<T>& rows, i64 j0, i64 j1,
                  Buffers<float>& buf) {
  constexpr int DC = R >= 4 ? std::max(1, 8 / R) : (R == 3 ? 2 : 4);
  i64 d = 0;
  for (; d + DC * W <= a.Dv; d += DC * W) values_cols<R, DC>(a, rows, j0, j1, d, buf);
  for (; d < a.Dv; d += W) values_cols<R, 1>(a, rows, j0, j1, d, buf);
}

// Whether values_group may run on the tile: no P == 0 among its R rows' n keys.
inline bool values_group_ok(i64 R, i64 n, const Buffers<float>& buf) {
  int zeros = 0;                                           // (no early exit: vectorised)
  for (i64 r = 0; r < R; ++r)
    for (i64 j = 0; j < n; ++j) zeros |= buf.s[r * BK + j] == 0.f;
  return !zeros;
}

// Rows per group the GQA loops take (2 .. 8, float compute, D_k and D_v on whole vectors).
// Not bfloat16 where the CPU has AVX512-BF16: forward.h's bf16 dot loops (scores_dot_bf16:
// vdpbf16ps on the rows as they lie; values_bf16: pairs of dims per float lane), head by
// head, took 0.90 of the GQA loops' CPU time on a decode step (16 sequences of 512-8192
// keys, GQA 32/8, D=128, one thread, alternating runs: 44 against 49 ms); with Q.Kᵀ on FMA
// pairs there too (dots_pairs16), paged_hot_cold.py's cache-resident step 11.1 ms against
// 12.7 for the GQA loops with k_pairs (the avx512 build), one thread.
template <typename A, typename T> inline bool on_group_loop(const Args<A>& a, i64 R) {
  if constexpr (!std::is_same_v<A, float>) return false;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) return false;
#endif
  return R >= 2 && R <= 8 && a.Dk % W == 0 && a.Dv % W == 0;
}

// Calls f with the group size R as a compile-time constant (on_group_loop's 2 .. 8).
template <typename F> inline void with_group(i64 R, F f) {
  switch (R) {
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

// One head's tile on forward.h's dot loops: scores, the row pass, P . V.
template <typename A, typename T>
void dot_tile(const Args<A>& a, const ListedRows<T>& rows, const Item& it, i64 k0, i64 n,
              i64 npad, TileKind kind, i64 R, Buffers<A>& buf) {
  scores_dot(a, rows, n, R, buf);
  rows_pass(a, it, k0, n, npad, kind, buf);
  values_axpy(a, rows, n, R, buf);
}

// The tile [k0, k0 + n) of every head's item on the GQA loops, key-major: KEYS keys of
// every head, then the next KEYS (a page holds a token's heads side by side, so this reads
// the pages front to back, which the hardware prefetcher follows; head by head read 256 of
// every 2048 bytes, H_kv passes over each page); then each head's row pass; then P . V by
// blocks of SUBV keys, every head's. n_ptr: the rows listed per head (prefetches).
template <int R, typename T>
void group_tile(const Args<float>& a, const PagedItem* const* its, i64 k0, i64 n, i64 n_ptr,
                i64 npad, TileKind kind, PagedBuffers<float, T>& pb) {
  constexpr int KEYS = R >= 8 ? 1 : 8 / R;
  constexpr i64 SUBV = 8;
  const auto dots = [&](auto pairs) {                      // pairs: k_pairs, at compile time
    constexpr bool P = decltype(pairs)::value;
    i64 j = 0;
    for (; j + KEYS <= n; j += KEYS)
      for (i64 h = 0; h < a.Hkv; ++h)
        dots_group<R, KEYS, P>(a, pb.rows(h, n_ptr), j, pb.heads[h]);
    for (; j < n; ++j)
      for (i64 h = 0; h < a.Hkv; ++h) dots_group<R, 1, P>(a, pb.rows(h, n_ptr), j, pb.heads[h]);
  };
  if (k_pairs<T>(a)) dots(std::true_type{});
  else dots(std::false_type{});
  bool ok = true;
  for (i64 h = 0; h < a.Hkv; ++h) {
    rows_pass(a, its[h]->it, k0, n, npad, kind, pb.heads[h]);
    ok = ok && values_group_ok(R, n, pb.heads[h]);
  }
  if (!ok) {                                               // some P == 0: the exact path
    for (i64 h = 0; h < a.Hkv; ++h) values_axpy(a, pb.rows(h, n_ptr), n, R, pb.heads[h]);
    return;
  }
  for (i64 j0 = 0; j0 < n; j0 += SUBV)
    for (i64 h = 0; h < a.Hkv; ++h)
      values_group<R>(a, pb.rows(h, n_ptr), j0, std::min(n, j0 + SUBV), pb.heads[h]);
}

// The H_kv items its[h] (head h) of one (sequence, query block, split) on the dot loops,
// tile by tile, every head's rows of the tile before the next tile (the page order): acc,
// m, l of head h in pb.heads[h] (R = G * nr rows each).
template <typename A, typename T>
void attend_paged_task(const Args<A>& a, const Pages<T>& pg, const T* q, const i64 (&sq)[2],
                       const PagedSeq& seq, const PagedItem* const* its,
                       PagedBuffers<A, T>& pb) {
  const Item& it = its[0]->it;                             // keys and rows: every head's
  const i64 R = a.G * it.nr;
  for (i64 h = 0; h < a.Hkv; ++h) clear_rows(a, R, pb.heads[h]);
  if (it.ke <= it.kb || it.nr <= 0) return;
  for (i64 h = 0; h < a.Hkv; ++h) gather_q_packed(a, q, sq, seq, *its[h], pb.heads[h]);
  if constexpr (std::is_same_v<A, float>) {
    if (on_group_loop<A, T>(a, R) && k_pairs<T>(a))        // group_tile's dots read q split
      for (i64 h = 0; h < a.Hkv; ++h) split_q(a, R, pb.heads[h]);
  }
  for_each_tile(a, it, false, [&](i64 k0, i64 n, i64 npad, TileKind kind, const Sub*, int) {
    const i64 n_ptr = std::min(TILE_PTRS, it.ke - k0);   // this tile and the prefetched rows
    for (i64 h = 0; h < a.Hkv; ++h)
      rows_of_tile(pg, its[h]->s, h, k0, n_ptr, pb.krow.data() + h * TILE_PTRS,
                   pb.vrow.data() + h * TILE_PTRS);
    if constexpr (std::is_same_v<A, float>) {
      if (on_group_loop<A, T>(a, R))
        return with_group(R, [&](auto g) {
          group_tile<decltype(g)::value>(a, its, k0, n, n_ptr, npad, kind, pb);
        });
    }
    for (i64 h = 0; h < a.Hkv; ++h) {                      // head h's V read while cached
      dot_tile(a, pb.rows(h, n_ptr), its[h]->it, k0, n, npad, kind, R, pb.heads[h]);
    }
  });
}

// The item's rows (acc, m, l in buf) finished into out / lse, or into its split's partial
// slots po (rows, D_v) / pl (rows,) when the sequence has several splits.
template <typename A, typename T>
void finish_item(const Args<A>& a, const PagedSeq& seq, const PagedItem& pi,
                 const Buffers<A>& buf, T* out, A* lse, A* po, A* pl) {
  const i64 nr = pi.it.nr, slot_rows = a.G * seq.rows;
  for (i64 g = 0; g < a.G; ++g)
    for (i64 r_i = 0; r_i < nr; ++r_i) {                   // row (head kvh * G + g, query r_i)
      const i64 r = g * nr + r_i;
      const A* acc = buf.acc.data() + r * a.DVP;
      if (seq.splits == 1) {
        const i64 flat = (seq.q_first + pi.qb * seq.rows + r_i) * a.Hq + pi.kvh * a.G + g;
        finish_row(acc, buf.m[r], buf.l[r], a.Dv, out + flat * a.Dv, lse + flat);
      } else {
        const i64 slot = seq.part0 + ((pi.kvh * seq.nqb + pi.qb) * seq.splits + pi.c) *
                                         slot_rows + r;
        finish_row(acc, buf.m[r], buf.l[r], a.Dv, po + slot * a.Dv, pl + slot);
      }
    }
}

// The partials of one (sequence, K/V head, query block) merged by LSE into out / lse (the
// rules of merge_row: an empty split adds nothing, NaN in any split's LSE -> NaN).
template <typename A, typename O>
void merge_paged(const Args<A>& a, const PagedSeq& seq, i64 kvh, i64 qb, const A* po,
                 const A* pl, O* out, A* lse, A* accv) {
  const i64 nr = std::min(seq.rows, seq.nq - qb * seq.rows), slot_rows = a.G * seq.rows;
  const i64 base = seq.part0 + (kvh * seq.nqb + qb) * seq.splits * slot_rows;
  for (i64 g = 0; g < a.G; ++g)
    for (i64 i = 0; i < nr; ++i) {                         // row (head kvh * G + g, query i)
      const i64 r = g * nr + i;
      const i64 flat = (seq.q_first + qb * seq.rows + i) * a.Hq + kvh * a.G + g;
      merge_row(pl + base + r, slot_rows, po + (base + r) * a.Dv, slot_rows * a.Dv, seq.splits,
                a.Dv, accv, out + flat * a.Dv, lse + flat);
    }
}

// A task of a call: one GEMM-loop item, or the H_kv items of one (sequence, query block,
// split) on the dot loops, head h's at first + h * stride (plan_paged's order: sequence,
// head, query block, split).
struct PagedTask {
  i64 first, stride;
  bool dot;
};
template <typename A>
std::vector<PagedTask> paged_tasks(const Args<A>& a, const std::vector<PagedSeq>& seqs,
                                   const std::vector<PagedItem>& items) {
  std::vector<PagedTask> tasks, dots;
  for (i64 i = 0; i < i64(items.size()); ++i) {
    const PagedItem& pi = items[i];
    if (!on_dot_loop(a, pi.it)) tasks.push_back({i, 0, false});
    else if (pi.kvh == 0) dots.push_back({i, seqs[pi.s].nqb * seqs[pi.s].splits, true});
  }
  // the dot tasks dearest first (keys x queries; the threads take the tasks in this order):
  // the last ones taken are the cheapest, so no thread waits long on another's last task
  // (16 decodes of 512-8192 keys on 2 threads: the plan order's finish, by key counts,
  // 1.03 of an even split, this 1.002); the GEMM tasks first, in the plan's order (a
  // thread's cached tiles serve the next query block of the same head)
  std::stable_sort(dots.begin(), dots.end(), [&](const PagedTask& x, const PagedTask& y) {
    const Item &p = items[x.first].it, &q = items[y.first].it;
    return (p.ke - p.kb) * p.nr > (q.ke - q.kb) * q.nr;
  });
  tasks.insert(tasks.end(), dots.begin(), dots.end());
  return tasks;
}

// The sequences' tasks, taken by the threads one at a time; each group of splits merged
// when its last split is done.
// alibi: (S, H_q) slopes in A, or null.
template <typename A, typename T>
void run_paged(const Args<A>& a, const Pages<T>& pg, const T* q, const i64 (&sq)[2],
               const std::vector<PagedSeq>& seqs, const std::vector<PagedItem>& items,
               i64 n_part_rows, const A* alibi, T* out, A* lse) {
  std::vector<A> po(n_part_rows * a.Dv), pl(n_part_rows);
  const std::vector<PagedTask> tasks = paged_tasks(a, seqs, items);
  const i64 n_tasks = i64(tasks.size());
  const i64 T_ = std::max<i64>(1, std::min<i64>(at::get_num_threads(), n_tasks));
  // each thread takes the next task when done with one (a thread slowed by other load, or
  // given the dear tasks, does not leave the others idle); tasks are small (plan_paged)
  std::atomic<i64> next{0};
  i64 max_rows = 1, max_tiles = 1;
  for (const auto& s : seqs) {
    max_rows = std::max(max_rows, s.rows);
    if (a.G * std::min(s.rows, s.nq) >= 16) max_tiles = std::max(max_tiles, (s.nk + BK - 1) / BK);
  }
  Args<A> la = a;                                          // lowp.h's buffers: a tile or
  la.NKP = (a.cache_kt ? max_tiles : 1) * BK;              // the cached head's tiles
  // the splits of one (sequence, K/V head, query block) are merged by the thread finishing
  // the last of them (no second parallel region after the tasks: on a loaded machine a
  // region waits for every thread to be scheduled): left[g] counts group g's splits to go
  std::vector<i64> group0(seqs.size(), -1);               // sequence -> its first group
  i64 n_groups = 0;
  for (i64 s = 0; s < i64(seqs.size()); ++s)
    if (seqs[s].splits > 1) {
      group0[s] = n_groups;
      n_groups += a.Hkv * seqs[s].nqb;
    }
  std::unique_ptr<std::atomic<i64>[]> left(new std::atomic<i64>[std::max<i64>(1, n_groups)]);
  for (i64 s = 0; s < i64(seqs.size()); ++s)
    for (i64 g = 0; seqs[s].splits > 1 && g < a.Hkv * seqs[s].nqb; ++g)
      left[group0[s] + g].store(seqs[s].splits, std::memory_order_relaxed);
  const auto finished = [&](const PagedItem& pi, std::vector<A>& accv) {  // pi's partials out
    const PagedSeq& seq = seqs[pi.s];
    if (seq.splits == 1) return;
    // acq_rel: the last split's thread sees every other split's partials
    if (left[group0[pi.s] + pi.kvh * seq.nqb + pi.qb].fetch_sub(1, std::memory_order_acq_rel) == 1)
      merge_paged(a, seq, pi.kvh, pi.qb, po.data(), pl.data(), out, lse, accv.data());
  };
  at::parallel_for(0, T_, 1, [&](i64, i64) {
    Buffers<A> buf(a, a.G * max_rows);
    std::vector<A> accv(a.Dv);                             // merge_paged's scratch
    PagedBuffers<A, T> pb(a, max_tiles);
    std::unique_ptr<LowpBuffers<T>> lb;                    // T GEMMs: packed K/V, Q, P in T
    std::vector<const PagedItem*> its(a.Hkv);
    Args<A> as = a;                                        // this sequence's ALiBi slopes
    for (i64 t = next++; t < n_tasks; t = next++) {
      const PagedTask& task = tasks[t];
      const PagedSeq& seq = seqs[items[task.first].s];
      as.alibi = alibi ? alibi + items[task.first].s * a.Hq : nullptr;
      if (!task.dot) {
        if constexpr (is_lowp<T>)
          if (a.lowp && !lb) lb.reset(new LowpBuffers<T>(la, a.G * max_rows));
        attend_paged_item(as, pg, q, sq, seq, items[task.first], buf, pb, lb.get());
        finish_item(a, seq, items[task.first], buf, out, lse, po.data(), pl.data());
        finished(items[task.first], accv);
        continue;
      }
      while (i64(pb.heads.size()) < a.Hkv) pb.heads.emplace_back(a, a.G * max_rows);
      for (i64 h = 0; h < a.Hkv; ++h) its[h] = &items[task.first + h * task.stride];
      attend_paged_task(as, pg, q, sq, seq, its.data(), pb);
      for (i64 h = 0; h < a.Hkv; ++h) {
        finish_item(a, seq, *its[h], pb.heads[h], out, lse, po.data(), pl.data());
        finished(*its[h], accv);
      }
    }
    if (lb && !a.lowp_emulate) at::native::cpublas::brgemm_release(true);  // AMX tile state
  });
}

// Cascade (serving.py's shared prefixes): rows src[i] of out / lse — a query's part over a
// shared prefix — merged by LSE into rows dst[i] — the same query's part over its own keys —
// in place, every head (the rules of merge_row: an empty part adds nothing, NaN -> NaN).
// out (total_q, H_q, D_v) in T, lse (total_q, H_q) in A; n pairs, no row both a src and a
// dst. A decode step's few rows run on the calling thread (no parallel region to wake).
template <typename T>
void merge_rows_into(T* out, compute_t<T>* lse, i64 Hq, i64 Dv, const i64* src,
                     const i64* dst, i64 n) {
  using A = compute_t<T>;
  const i64 grain = std::max<i64>(1, (i64(1) << 16) / std::max<i64>(1, Dv));  // (row, head)s
  at::parallel_for(0, n * Hq, grain, [&](i64 r0, i64 r1) {
    std::vector<A> parts(2 * Dv), accv(Dv);                // (2, D_v): prefix, own
    for (i64 r = r0; r < r1; ++r) {                        // (pair r / H_q, head r % H_q)
      const i64 fs = src[r / Hq] * Hq + r % Hq, fd = dst[r / Hq] * Hq + r % Hq;
      const A lses[2] = {lse[fs], lse[fd]};
      for (i64 d = 0; d < Dv; ++d) {
        parts[d] = A(out[fs * Dv + d]);
        parts[Dv + d] = A(out[fd * Dv + d]);
      }
      merge_row(lses, 1, parts.data(), Dv, 2, Dv, accv.data(), out + fd * Dv, lse + fd);
    }
  });
}

// The op: paged_merge_rows(out, lse, src, dst) on a paged_attend call's (out, lse).
void paged_merge_rows(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& src,
                      const at::Tensor& dst) {
  TORCH_CHECK(out.dim() == 3 && out.is_contiguous() && out.device().is_cpu(),
              "attnkit native paged_merge_rows: out must be a contiguous CPU (total_q, H_q, "
              "D_v) tensor, got ", out.sizes());
  TORCH_CHECK(lse.dim() == 2 && lse.is_contiguous() && lse.size(0) == out.size(0) &&
                  lse.size(1) == out.size(1),
              "attnkit native paged_merge_rows: lse must be contiguous (total_q, H_q) = (",
              out.size(0), ", ", out.size(1), "), got ", lse.sizes());
  TORCH_CHECK(src.scalar_type() == at::kLong && dst.scalar_type() == at::kLong &&
                  src.dim() == 1 && src.is_contiguous() && dst.is_contiguous() &&
                  dst.sizes() == src.sizes(),
              "attnkit native paged_merge_rows: src and dst must be contiguous int64 (n,)");
  const i64 total = out.size(0), n = src.numel();
  const i64* s = src.data_ptr<i64>();
  const i64* d = dst.data_ptr<i64>();
  std::vector<char> role(total, 0);                        // 1 = a src row, 2 = a dst row
  for (i64 i = 0; i < n; ++i) {
    TORCH_CHECK(s[i] >= 0 && s[i] < total && d[i] >= 0 && d[i] < total,
                "attnkit native paged_merge_rows: pair ", i, " (", s[i], " -> ", d[i],
                ") is out of range: out has ", total, " rows");
    TORCH_CHECK(role[s[i]] != 2 && role[d[i]] == 0 && s[i] != d[i],
                "attnkit native paged_merge_rows: row ", role[d[i]] ? d[i] : s[i],
                " is used twice (a dst row must be no other pair's src or dst)");
    role[s[i]] = 1;
    role[d[i]] = 2;
  }
  auto run = [&](auto* o, auto* l) {
    using T = std::remove_pointer_t<decltype(o)>;
    TORCH_CHECK(lse.scalar_type() == c10::CppTypeToScalarType<compute_t<T>>::value,
                "attnkit native paged_merge_rows: lse must be ",
                c10::CppTypeToScalarType<compute_t<T>>::value, " for out ", out.scalar_type());
    merge_rows_into<T>(o, static_cast<compute_t<T>*>(l), out.size(1), out.size(2), s, d, n);
  };
  void* l = lse.data_ptr();
  switch (out.scalar_type()) {
    case at::kFloat: return run(out.data_ptr<float>(), l);
    case at::kDouble: return run(out.data_ptr<double>(), l);
    case at::kBFloat16: return run(out.data_ptr<at::BFloat16>(), l);
    case at::kHalf: return run(out.data_ptr<at::Half>(), l);
    default: TORCH_CHECK(false, "attnkit native paged_merge_rows: dtype ", out.scalar_type());
  }
}

}  // namespace
}  // namespace attnkit_native

TORCH_LIBRARY_FRAGMENT(attnkit_native, m) {
  m.def("paged_merge_rows(Tensor(a!) out, Tensor(b!) lse, Tensor src_rows, Tensor dst_rows) "
        "-> ()",
        &attnkit_native::paged_merge_rows);
}
