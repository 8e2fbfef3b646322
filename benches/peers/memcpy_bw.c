// The hardware reference for the shared-memory collectives: single-core memcpy bandwidth (bytes
// copied per second) of a 64 MiB buffer, best of 10. Checks that the copy arrived.
//   gcc -O2 benches/peers/memcpy_bw.c -o /tmp/memcpy_bw && /tmp/memcpy_bw
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int main(void) {
  size_t n = (size_t)64 << 20;
  unsigned char* a = malloc(n);
  unsigned char* b = malloc(n);
  if (!a || !b) return 1;
  for (size_t i = 0; i < n; i++) a[i] = (unsigned char)(i * 7 + 1);
  memset(b, 0, n);
  double best = 1e9;
  for (int r = 0; r < 10; r++) {
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    memcpy(b, a, n);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double dt = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
    if (dt < best) best = dt;
  }
  if (memcmp(a, b, n) != 0) {
    fprintf(stderr, "memcpy_bw: the copy differs from the source\n");
    return 1;
  }
  printf("memcpy 64MiB: %.2f GB/s (copied bytes per second)\n", (double)n / best / 1e9);
  free(a);
  free(b);
  return 0;
}
