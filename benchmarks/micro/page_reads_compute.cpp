// Build: g++ -O3 -march=native -o /tmp/prc benchmarks/micro/page_reads_compute.cpp
// Run:   /tmp/prc W   (W = 10: about the paged decode's own compute per 4 KB, ~215 ns)
// Xeon of 2026-12-04, W=10: no prefetch strided 929 / front-to-back 558 ns per 4 KB; best
// prefetch strided 393 (t2, 32 rows ahead) / front-to-back 421 (t2, 8); reads alone ~330.
// Overlap of DRAM reads with dependent compute on one thread, with software prefetch: random 32 KB
// blocks of a 1 GB buffer walked (mode 0) head-strided over 8-block tiles (the kernel's order:
// for tile: for head: for block: for slot), or (mode 1) each block front to back; after each
// 256 B row, W iterations of 8 FMA chains that depend on the row's data. Prefetch: the row
// PF rows ahead in the walk (0 = none), hint t0 or t2. ns per 4 KB (a key of 8 K/V heads).
#include <immintrin.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <algorithm>
#include <random>
#include <time.h>
typedef long long i64;
static const i64 BLK = 32768, ROW = 2048, HB = 256, NH = 8, SLOTS = 16;
static double tnow() { timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static __m512 f[8];
static inline void work(int w, __m512 x) {
  __m512 a0 = f[0], a1 = f[1], a2 = f[2], a3 = f[3], a4 = f[4], a5 = f[5], a6 = f[6], a7 = f[7];
  for (int i = 0; i < w; ++i) {
    a0 = _mm512_fmadd_ps(a0, x, x); a1 = _mm512_fmadd_ps(a1, x, x); a2 = _mm512_fmadd_ps(a2, x, x); a3 = _mm512_fmadd_ps(a3, x, x);
    a4 = _mm512_fmadd_ps(a4, x, x); a5 = _mm512_fmadd_ps(a5, x, x); a6 = _mm512_fmadd_ps(a6, x, x); a7 = _mm512_fmadd_ps(a7, x, x);
  }
  f[0] = a0; f[1] = a1; f[2] = a2; f[3] = a3; f[4] = a4; f[5] = a5; f[6] = a6; f[7] = a7;
}
static inline __m512 rd(const char* p) {
  __m512 a = _mm512_load_ps((const float*)p);
  a = _mm512_add_ps(a, _mm512_load_ps((const float*)(p + 64)));
  a = _mm512_add_ps(a, _mm512_load_ps((const float*)(p + 128)));
  return _mm512_add_ps(a, _mm512_load_ps((const float*)(p + 192)));
}
template <int HINT> static inline void pf(const char* p) {
  for (int b = 0; b < 256; b += 64) _mm_prefetch(p + b, (_mm_hint)HINT);
}
int main(int argc, char** argv) {
  const int W = atoi(argv[1]);
  const i64 big = i64(1) << 30, N = 16384;
  char* buf = (char*)aligned_alloc(4096, big); memset(buf, 0, big);
  std::vector<i64> perm(big / BLK); for (size_t i = 0; i < perm.size(); ++i) perm[i] = i;
  std::mt19937_64 rng(1);
  std::vector<const char*> rows(N * NH * SLOTS + 64);
  auto walk = [&](int mode, i64 mod) {
    i64 k = 0;
    if (mode == 0) {
      for (i64 i0 = 0; i0 < N; i0 += 8) for (i64 h = 0; h < NH; ++h) for (i64 i = i0; i < i0 + 8; ++i)
        for (i64 s = 0; s < SLOTS; ++s) rows[k++] = buf + (perm[i] % mod) * BLK + s * ROW + h * HB;
    } else {
      for (i64 i = 0; i < N; ++i) for (i64 o = 0; o < BLK; o += HB) rows[k++] = buf + (perm[i] % mod) * BLK + o;
    }
    for (i64 j = k; j < i64(rows.size()); ++j) rows[j] = rows[k - 1];
  };
  auto pass = [&](int w, int d, int hint) {
    const i64 n = N * NH * SLOTS; __m512 x = _mm512_set1_ps(0.5f);
    double t0 = tnow();
    for (i64 j = 0; j < n; ++j) {
      if (d) { if (hint == 0) pf<_MM_HINT_T0>(rows[j + d]); else pf<_MM_HINT_T2>(rows[j + d]); }
      x = _mm512_add_ps(x, rd(rows[j]));
      work(w, x);
    }
    f[0] = _mm512_add_ps(f[0], x);
    return (tnow() - t0) / (N * BLK / 4096.0) * 1e9;
  };
  struct Cfg { int d, hint; };
  std::vector<Cfg> cfgs = {{0, 0}, {4, 0}, {8, 0}, {16, 0}, {32, 0}, {8, 2}, {16, 2}, {32, 2}, {64, 2}};
  for (int mode = 0; mode < 2; ++mode) {
    std::vector<std::vector<double>> r(cfgs.size() + 2);
    for (int rep = 0; rep < 3; ++rep) {
      std::shuffle(perm.begin(), perm.end(), rng);
      walk(mode, 32); r[0].push_back(pass(W, 0, 0));                 // compute, 1 MB (L2)
      walk(mode, perm.size()); r[1].push_back(pass(0, 0, 0));        // reads only
      for (size_t c = 0; c < cfgs.size(); ++c) r[c + 2].push_back(pass(W, cfgs[c].d, cfgs[c].hint));
    }
    for (auto& v : r) std::sort(v.begin(), v.end());
    printf("%s W=%d: compute-only(L2) %4.0f  reads-only %4.0f  | both, prefetch rows ahead:", mode ? "front-to-back" : "strided-8blk ", W, r[0][1], r[1][1]);
    for (size_t c = 0; c < cfgs.size(); ++c) printf("  %s%d %4.0f", cfgs[c].hint ? "t2/" : "t0/", cfgs[c].d, r[c + 2][1]);
    printf("  ns/4KB\n"); fflush(stdout);
  }
  float s[16]; _mm512_storeu_ps(s, f[0]); fprintf(stderr, "%f\n", s[0]);
}
