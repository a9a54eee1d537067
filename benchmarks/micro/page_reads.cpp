// Build: g++ -O3 -march=native -o /tmp/page_reads benchmarks/micro/page_reads.cpp
// Run:   /tmp/page_reads [blocks per pass = 16384] [reps = 5]   (MB=<buffer MiB>, HUGE=1: THP)
// Xeon of 2026-12-04 (shared host), 1 GB buffer: every order 12.7-15 GB/s on one thread;
// front to back 0.94-0.97 of the head-strided order; software prefetch slightly slower.
// One-thread read bandwidth: random 32 KB blocks (16 slots x 8 heads x 256 B) of a 1 GB buffer,
// read (a) head-strided per block, (a8) head-strided over a tile of 8 blocks (the kernel's
// current order), (b) each block front to back; with / without software prefetch.
#include <immintrin.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <random>
#include <time.h>
#include <sys/mman.h>
typedef long long i64;
static const i64 BLK = 32768, ROW = 2048, HB = 256, NH = 8, SLOTS = 16;
static double tnow() { timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static inline __m512i rd256(const char* p, __m512i a) {
  a = _mm512_add_epi64(a, _mm512_load_si512(p));
  a = _mm512_add_epi64(a, _mm512_load_si512(p + 64));
  a = _mm512_add_epi64(a, _mm512_load_si512(p + 128));
  return _mm512_add_epi64(a, _mm512_load_si512(p + 192));
}
static inline void pf(const char* p, i64 n) { for (i64 b = 0; b < n; b += 64) _mm_prefetch(p + b, _MM_HINT_T0); }
int main(int argc, char** argv) {
  const i64 SIZE = getenv("MB") ? i64(atoll(getenv("MB"))) << 20 : i64(1) << 30, NB = SIZE / BLK;
  const i64 N = argc > 1 ? atoll(argv[1]) : 16384;   // blocks per pass (512 MB)
  const int reps = argc > 2 ? atoi(argv[2]) : 5;
  char* buf = (char*)aligned_alloc(4096, SIZE);
  if (getenv("HUGE")) madvise(buf, SIZE, MADV_HUGEPAGE);
  memset(buf, 1, SIZE);
  std::vector<i64> perm(NB);
  for (i64 i = 0; i < NB; ++i) perm[i] = i;
  std::mt19937_64 rng(1);
  __m512i acc = _mm512_setzero_si512();
  struct V { const char* name; int mode; int pfd; };
  // mode 0: head-strided per block; 1: head-strided over 8-block tile; 2: front to back; 3: sequential whole
  std::vector<V> vs = {{"a  strided/blk      ", 0, 0}, {"a  strided/blk +pf16", 0, 16},
                       {"a8 strided/8blk     ", 1, 0}, {"a8 strided/8blk+pf16", 1, 16},
                       {"b  front-to-back    ", 2, 0}, {"b  f2b +pf 1 blk    ", 2, 1},
                       {"b  f2b +pf 2KB ahead", 2, -1}, {"seq whole           ", 3, 0}};
  std::vector<std::vector<double>> gbs(vs.size());
  for (int r = 0; r < reps; ++r) {
    std::shuffle(perm.begin(), perm.end(), rng);
    for (size_t vi = 0; vi < vs.size(); ++vi) {
      const V& v = vs[vi];
      double t0 = tnow();
      if (v.mode == 0) {
        for (i64 i = 0; i < N; ++i) {
          const char* b = buf + perm[i] * BLK;
          for (i64 h = 0; h < NH; ++h)
            for (i64 s = 0; s < SLOTS; ++s) {
              if (v.pfd) {  // prefetch the row pfd rows ahead in the same walk order
                i64 q = h * SLOTS + s + v.pfd, bi = i + q / (NH * SLOTS); q %= NH * SLOTS;
                if (bi < N) pf(buf + perm[bi] * BLK + (q % SLOTS) * ROW + (q / SLOTS) * HB, HB);
              }
              acc = rd256(b + s * ROW + h * HB, acc);
            }
        }
      } else if (v.mode == 1) {
        for (i64 i0 = 0; i0 < N; i0 += 8)
          for (i64 h = 0; h < NH; ++h)
            for (i64 i = i0; i < i0 + 8 && i < N; ++i)
              for (i64 s = 0; s < SLOTS; ++s) {
                if (v.pfd) {  // next rows of this head's walk (within the tile)
                  i64 q = (i - i0) * SLOTS + s + v.pfd;
                  if (q < 8 * SLOTS && i0 + q / SLOTS < N) pf(buf + perm[i0 + q / SLOTS] * BLK + (q % SLOTS) * ROW + h * HB, HB);
                }
                acc = rd256(buf + perm[i] * BLK + s * ROW + h * HB, acc);
              }
      } else if (v.mode == 2) {
        for (i64 i = 0; i < N; ++i) {
          const char* b = buf + perm[i] * BLK;
          const char* nb = i + 1 < N ? buf + perm[i + 1] * BLK : b;
          for (i64 o = 0; o < BLK; o += HB) {
            if (v.pfd == 1) pf(nb + o, HB);
            else if (v.pfd == -1) pf(o + ROW < BLK ? b + o + ROW : nb + (o + ROW - BLK), HB);
            acc = rd256(b + o, acc);
          }
        }
      } else {
        const i64 start = N < NB ? (perm[0] % (NB - N)) * BLK : 0;
        for (i64 o = 0; o < N * BLK; o += HB) acc = rd256(buf + start + o, acc);
      }
      double dt = tnow() - t0;
      gbs[vi].push_back(N * BLK / dt / 1e9);
    }
  }
  for (size_t vi = 0; vi < vs.size(); ++vi) {
    auto g = gbs[vi]; std::sort(g.begin(), g.end());
    printf("%s  median %6.2f GB/s  (min %6.2f max %6.2f)\n", vs[vi].name, g[g.size() / 2], g.front(), g.back());
  }
  long long sink[8]; _mm512_storeu_si512(sink, acc); fprintf(stderr, "%lld\n", sink[0]);
}
