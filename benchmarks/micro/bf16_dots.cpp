// Build: g++ -O3 -march=native -o /tmp/bf16_dots benchmarks/micro/bf16_dots.cpp
// Xeon of 2026-12-04: current 12.2, keys-4 10.5, FMA on pairs 8.1 ns per key and K/V head.
// QK scores of R=4 bf16 query rows against K rows (D=128, bf16) by vdpbf16ps, rows L1-resident
// (listed pointers, as paged.h's ListedRows), one thread: (i) the kernel's order (dots_bf16<16>:
// per query row, 16 keys' accumulators, a masked K load per vdpbf16ps, lane_sums16 per row);
// (ii) keys 4 at a time, q (4 rows x 4 chunks) in registers, 4 K loads per 16 vdpbf16ps, one
// lane_sums16 per 4 keys x 4 rows. ns and cycles (at the measured clock) per key and K/V head.
#include <immintrin.h>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <vector>
typedef long long i64;
static double tnow() { timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
constexpr int KD = 32, BK = 128, D = 128, R = 4;
static inline __m512 lane_sums16(const __m512 (&x)[16]) {
  __m512 b[16], c[4];
  for (int i : {0, 1, 2, 3, 8, 9, 10, 11})
    b[i] = _mm512_shuffle_f32x4(x[i], x[i + 4], 0x44) + _mm512_shuffle_f32x4(x[i], x[i + 4], 0xee);
  for (int i = 0; i < 4; ++i)
    c[i] = _mm512_shuffle_f32x4(b[i], b[i + 8], 0x88) + _mm512_shuffle_f32x4(b[i], b[i + 8], 0xdd);
  const __m512 d0 = _mm512_unpacklo_ps(c[0], c[1]) + _mm512_unpackhi_ps(c[0], c[1]);
  const __m512 d1 = _mm512_unpacklo_ps(c[2], c[3]) + _mm512_unpackhi_ps(c[2], c[3]);
  return (__m512)_mm512_unpacklo_pd((__m512d)d0, (__m512d)d1) + (__m512)_mm512_unpackhi_pd((__m512d)d0, (__m512d)d1);
}
__attribute__((noinline)) void dots_cur(const unsigned short* qh, const unsigned short* const* kj, float* s, i64 n) {
  for (i64 j = 0; j < n; j += 16)
    for (i64 r = 0; r < R; ++r) {
      __m512 acc[16];
      for (int u = 0; u < 16; ++u) acc[u] = _mm512_setzero_ps();
      for (i64 d = 0; d < D; d += KD) {
        const __m512bh qd = (__m512bh)_mm512_loadu_si512(qh + r * D + d);
        for (int u = 0; u < 16; ++u)
          acc[u] = _mm512_dpbf16_ps(acc[u], (__m512bh)_mm512_maskz_loadu_epi16(~__mmask32(0), kj[j + u] + d), qd);
      }
      _mm512_storeu_ps(s + r * BK + j, lane_sums16(acc));
    }
}
__attribute__((noinline)) void dots_new(const unsigned short* qh, const unsigned short* const* kj, float* s, i64 n) {
  __m512bh q[R][D / KD];
  for (int r = 0; r < R; ++r) for (int c = 0; c < D / KD; ++c) q[r][c] = (__m512bh)_mm512_loadu_si512(qh + r * D + c * KD);
  for (i64 j = 0; j < n; j += 4) {
    __m512 acc[16];                                  // acc[r * 4 + u]
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (int c = 0; c < D / KD; ++c) {
      __m512bh k[4];
      for (int u = 0; u < 4; ++u) k[u] = (__m512bh)_mm512_loadu_si512(kj[j + u] + c * KD);
      for (int r = 0; r < R; ++r) for (int u = 0; u < 4; ++u) acc[r * 4 + u] = _mm512_dpbf16_ps(acc[r * 4 + u], k[u], q[r][c]);
    }
    float t[16];
    _mm512_storeu_ps(t, lane_sums16(acc));           // t[r * 4 + u]
    for (int r = 0; r < R; ++r) for (int u = 0; u < 4; ++u) s[r * BK + j + u] = t[r * 4 + u];
  }
}

// (iii) FMAs on the bf16 pairs: a 64 B load of K is 16 floats of the even d (<< 16) and 16 of
// the odd d (& 0xffff0000); q split likewise once (qs: per row and chunk, even then odd floats).
__attribute__((noinline)) void dots_pairs(const float* qs, const unsigned short* const* kj, float* s, i64 n) {
  const __m512i hi = _mm512_set1_epi32(int(0xffff0000u));
  for (i64 j = 0; j < n; j += 4) {
    __m512 acc[16];                                  // acc[r * 4 + u]
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (int c = 0; c < D / KD; ++c) {
      __m512 ke[4], ko[4];
      for (int u = 0; u < 4; ++u) {
        const __m512i x = _mm512_loadu_si512(kj[j + u] + c * KD);
        ke[u] = (__m512)_mm512_slli_epi32(x, 16);
        ko[u] = (__m512)_mm512_and_si512(x, hi);
      }
      for (int r = 0; r < R; ++r) {
        const __m512 qe = _mm512_loadu_ps(qs + (r * D + c * KD)), qo = _mm512_loadu_ps(qs + (r * D + c * KD) + 16);
        for (int u = 0; u < 4; ++u) acc[r * 4 + u] = _mm512_fmadd_ps(qo, ko[u], _mm512_fmadd_ps(qe, ke[u], acc[r * 4 + u]));
      }
    }
    float t[16];
    _mm512_storeu_ps(t, lane_sums16(acc));
    for (int r = 0; r < R; ++r) for (int u = 0; u < 4; ++u) s[r * BK + j + u] = t[r * 4 + u];
  }
}
int main() {
  const i64 n = BK, H = 8;                           // a tile of 128 keys, 8 heads' rows in pages
  std::vector<unsigned short> pool(n * H * D), qh(R * D);
  for (size_t i = 0; i < pool.size(); ++i) pool[i] = 0x3f80 + (i % 7);
  for (size_t i = 0; i < qh.size(); ++i) qh[i] = 0x3f80 + (i % 5);
  std::vector<const unsigned short*> rows(n);
  for (i64 j = 0; j < n; ++j) rows[j] = pool.data() + j * H * D;   // head 0, stride H * D
  std::vector<float> s1(R * BK), s2(R * BK), s3(R * BK), qs(R * D);
  for (int r = 0; r < R; ++r) for (int c = 0; c < D / KD; ++c) for (int i = 0; i < 16; ++i) {
    unsigned e = unsigned(qh[r * D + c * KD + 2 * i]) << 16, o = unsigned(qh[r * D + c * KD + 2 * i + 1]) << 16;
    memcpy(&qs[r * D + c * KD + i], &e, 4); memcpy(&qs[r * D + c * KD + 16 + i], &o, 4);
  }
  dots_pairs(qs.data(), rows.data(), s3.data(), n);

  dots_cur(qh.data(), rows.data(), s1.data(), n); dots_new(qh.data(), rows.data(), s2.data(), n);
  double md = 0; for (int i = 0; i < R * BK; ++i) md = std::max(md, (double)std::abs(s1[i] - s2[i]));
  double md3 = 0; for (int i = 0; i < R * BK; ++i) md3 = std::max(md3, (double)std::abs(s1[i] - s3[i]) / std::abs(s1[i]));
  const int reps = 200000;
  for (int round = 0; round < 3; ++round) {
    double t0 = tnow(); for (int i = 0; i < reps; ++i) dots_cur(qh.data(), rows.data(), s1.data(), n);
    double t1 = tnow(); for (int i = 0; i < reps; ++i) dots_new(qh.data(), rows.data(), s2.data(), n);
    double t2 = tnow(); for (int i = 0; i < reps; ++i) dots_pairs(qs.data(), rows.data(), s3.data(), n);
    double t3 = tnow();
    printf("current %.2f, keys-4/q-in-registers %.2f, FMA on bf16 pairs %.2f ns per key and K/V head (R=4, D=128)  (max diff %.1e, pairs rel %.1e)\n", (t1 - t0) / reps / n * 1e9, (t2 - t1) / reps / n * 1e9, (t3 - t2) / reps / n * 1e9, md, md3);
  }
}
