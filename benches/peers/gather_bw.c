/* gather_bw.c: what gathering random rows of a large table costs on this machine, with nothing else
 * in the way: the floor of a parameter server's pullRows (issue 29, target 3).
 *
 *   gcc -O2 benches/peers/gather_bw.c -o /tmp/gather_bw && /tmp/gather_bw [ROWS DIM K REPS]
 *
 * A ROWS x DIM float table (default 1M x 64, 256 MB, touched first), then REPS times (default 9): K
 * random row ids (default 10000), and the K rows copied into one buffer in id order, prefetching 8
 * rows ahead as the server does (src/torch/ps/server_rows.cc). Prints each repetition's time and the
 * median, in ms, and the rows' GB/s. The first repetition is usually slower (TLB and caches cold). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int cmp(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

int main(int argc, char** argv) {
  size_t rows = argc > 1 ? strtoull(argv[1], NULL, 10) : (size_t)1 << 20;
  size_t dim = argc > 2 ? strtoull(argv[2], NULL, 10) : 64;
  size_t k = argc > 3 ? strtoull(argv[3], NULL, 10) : 10000;
  int reps = argc > 4 ? atoi(argv[4]) : 9;
  if (!rows || !dim || !k || reps < 1 || reps > 1000) {
    fprintf(stderr, "usage: gather_bw [ROWS DIM K REPS]\n");
    return 2;
  }
  const size_t row_bytes = dim * sizeof(float);
  float* table = malloc(rows * row_bytes);
  float* out = malloc(k * row_bytes);
  size_t* ids = malloc(k * sizeof(size_t));
  double* ms = malloc((size_t)reps * sizeof(double));
  if (!table || !out || !ids || !ms) {
    fprintf(stderr, "gather_bw: out of memory\n");
    return 1;
  }
  for (size_t i = 0; i < rows * dim; ++i) table[i] = (float)(i % 1000);
  uint64_t s = 88172645463325252ull;
  double check = 0;
  for (int r = 0; r < reps; ++r) {
    for (size_t i = 0; i < k; ++i) {
      s ^= s << 13, s ^= s >> 7, s ^= s << 17;
      ids[i] = (size_t)(s % rows);
    }
    double t0 = now();
    for (size_t i = 0; i < k; ++i) {
      if (i + 8 < k) {
        const char* p = (const char*)(table + ids[i + 8] * dim);
        for (size_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(p + b);
      }
      memcpy(out + i * dim, table + ids[i] * dim, row_bytes);
    }
    ms[r] = (now() - t0) * 1e3;
    check += out[(k - 1) * dim];
    printf("rep %d: %.3f ms\n", r + 1, ms[r]);
  }
  qsort(ms, (size_t)reps, sizeof(double), cmp);
  double med = ms[reps / 2];
  printf("gather_bw rows=%zu dim=%zu k=%zu: median %.3f ms, %.2f GB/s of rows (check %.0f)\n", rows, dim, k, med,
         (double)(k * row_bytes) / (med * 1e6), check);
  return 0;
}
