// Peer driver: OpenMPI MPI_Allreduce (float sum) at the sizes of benches/comm.sh, nccl-tests
// style busbw = algbw * 2(n-1)/n. One line per size from rank 0:
//   mpi world=2 bytes=4096 time_us=4.3 algbw=0.953 busbw=0.953 wrong=0 p50_us=4.1 p99_us=6.0 max_us=31.2
// time_us is rank 0's mean over 2e8/bytes iterations (3..200; env ITERS sets it) after 2 warm-up calls;
// p50/p99/max are percentiles of rank 0's per-call times in that loop. The result of
// the last call is checked on every rank (inputs rank+1+i%4, so each element's sum is exact); the
// program exits 1 if any element was wrong.
//   mpicc -O2 benches/peers/mpi_allreduce.c -o /tmp/mpi_allreduce
//   mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2 /tmp/mpi_allreduce [FLOATS...]
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

static int cmp_double(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank, world;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  long defaults[] = {1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22, 1 << 24};
  int nsizes = argc > 1 ? argc - 1 : 6;
  long total_wrong = 0, my_wrong = 0;  // mine too: the sum over ranks goes through MPI itself
  for (int s = 0; s < nsizes; s++) {
    long n = argc > 1 ? atol(argv[s + 1]) : defaults[s];
    if (n <= 0) {
      if (rank == 0) fprintf(stderr, "mpi_allreduce: bad size '%s' (floats)\n", argv[s + 1]);
      MPI_Abort(MPI_COMM_WORLD, 2);
    }
    float* a = malloc((size_t)n * 4);
    float* b = malloc((size_t)n * 4);
    for (long i = 0; i < n; i++) a[i] = (float)(rank + 1 + i % 4);
    int iters = (int)(2e8 / ((double)n * 4.0));
    if (iters < 3) iters = 3;
    if (iters > 200) iters = 200;
    if (getenv("ITERS")) iters = atoi(getenv("ITERS"));
    if (iters < 1) iters = 1;
    double* each = malloc((size_t)iters * sizeof(double));
    for (int w = 0; w < 2; w++) MPI_Allreduce(a, b, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    for (int i = 0; i < iters; i++) {
      double c0 = MPI_Wtime();
      MPI_Allreduce(a, b, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      each[i] = MPI_Wtime() - c0;
    }
    double dt = (MPI_Wtime() - t0) / iters;
    qsort(each, (size_t)iters, sizeof(double), cmp_double);
    long wrong = 0;
    for (long i = 0; i < n; i++) {
      double expect = (double)world * (world + 1) / 2 + (double)world * (double)(i % 4);
      wrong += b[i] != (float)expect;
    }
    my_wrong += wrong;
    MPI_Allreduce(MPI_IN_PLACE, &wrong, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    total_wrong += wrong;
    if (rank == 0) {
      double alg = (double)n * 4 / dt / 1e9;
      printf("mpi world=%d bytes=%ld time_us=%.1f algbw=%.3f busbw=%.3f wrong=%ld p50_us=%.1f p99_us=%.1f max_us=%.1f\n",
             world, n * 4, dt * 1e6, alg, alg * 2 * (world - 1) / world, wrong, each[(iters - 1) / 2] * 1e6,
             each[(long)((iters - 1) * 0.99 + 0.5)] * 1e6, each[iters - 1] * 1e6);
      fflush(stdout);
    }
    free(a);
    free(b);
    free(each);
  }
  MPI_Finalize();
  if (my_wrong != 0) fprintf(stderr, "mpi_allreduce: rank %d: %ld wrong elements\n", rank, my_wrong);
  return total_wrong == 0 && my_wrong == 0 ? 0 : 1;
}
