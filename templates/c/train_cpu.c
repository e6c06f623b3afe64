// train_cpu.c: train_cpu.h. Hand-written: these are numpy's operations, not derived from a
// spec. The products sum in double, so any order gives nearly always the correctly
// rounded float32: numpy's BLAS, in its own order, rounds the same sums from float32
// partial sums. Rows go over OpenMP's threads (make cpu OPENMP=1) where a product is large
// enough; each element has one thread and one order, so a rerun gives the same bits.
#include <stdlib.h>

#include "error.h"
#include "train_cpu.h"

enum { PARALLEL_MACS = 1 << 20 };   // below this a product runs on one thread

void eg_matmul(const float* a, const float* b, float* c, int m, int n, int k, int ta, int tb,
               int add) {
#pragma omp parallel if ((long long)m * n * k >= PARALLEL_MACS)
  {
  // a thread's row buffers, once a call (not once a row)
  float* a_row = malloc(sizeof *a_row * (size_t)k);
  double* sums = malloc(sizeof *sums * (size_t)n);
  if (!a_row || !sums) eg_fail("out of memory");
#pragma omp for schedule(static)
  for (int i = 0; i < m; ++i) {
    for (int p = 0; p < k; ++p) a_row[p] = ta ? a[(long long)p * m + i] : a[(long long)i * k + p];
    if (tb) {   // a dot product with each row of b
      for (int j = 0; j < n; ++j) {
        const float* b_row = b + (long long)j * k;
        double sum = 0.0;
#pragma omp simd reduction(+ : sum)
        for (int p = 0; p < k; ++p) sum += (double)a_row[p] * b_row[p];
        sums[j] = sum;
      }
    } else {    // the rows of b, each scaled by its element of a's row
      for (int j = 0; j < n; ++j) sums[j] = 0.0;
      for (int p = 0; p < k; ++p) {
        const double x = a_row[p];
        const float* b_row = b + (long long)p * n;
#pragma omp simd
        for (int j = 0; j < n; ++j) sums[j] += x * b_row[j];
      }
    }
    float* c_row = c + (long long)i * n;
    for (int j = 0; j < n; ++j) c_row[j] = add ? c_row[j] + (float)sums[j] : (float)sums[j];
  }
  free(a_row);
  free(sums);
  }
}

void eg_add(float* y, const float* x, long long n) {
  for (long long i = 0; i < n; ++i) y[i] += x[i];
}

void eg_add_rows(float* y, const float* b, long long rows, int cols) {
  for (long long r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) y[r * cols + c] += b[c];
}

void eg_fill_columns(float* x, long long rows, int cols, int from, float value) {
  for (long long r = 0; r < rows; ++r)
    for (int c = from; c < cols; ++c) x[r * cols + c] = value;
}

float eg_mean(const float* x, long long n) {
  double sum = 0.0;
  for (long long i = 0; i < n; ++i) sum += x[i];
  return (float)(sum / (double)n);
}

double eg_sum_squares(const float* x, long long n) {
  double sum = 0.0;
  for (long long i = 0; i < n; ++i) sum += (double)x[i] * x[i];
  return sum;
}
