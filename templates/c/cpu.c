// cpu.c: the backend (backend.h) on the CPU, for `make cpu`: memory is the host's, and a
// linear layer's product is a dot product a row of its weight (hand-written, vectorised by
// the compiler: -fopenmp-simd), the rows over OpenMP's threads where the program is built
// with it (make cpu OPENMP=1) and the layer is large enough to pay for them.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "backend.h"
#include "error.h"

enum { PARALLEL_MACS = 1 << 20,    // below this a layer runs on one thread: the threads cost more
       ROWS = 4 };

const char* eg_backend(void) {
  static char name[64];
#ifdef _OPENMP
  snprintf(name, sizeof name, "cpu, %d OpenMP threads", omp_get_max_threads());
#else
  snprintf(name, sizeof name, "cpu, one thread");
#endif
  return name;
}

void* eg_alloc(size_t bytes) {
  void* p = calloc(1, bytes);
  if (!p) eg_fail("out of memory (%zu bytes)", bytes);
  return p;
}

const float* eg_weights(float* host, long long floats) {
  (void)floats;
  return host;
}

void eg_upload(void* device, const void* host, size_t bytes) { memcpy(device, host, bytes); }
void eg_download(void* host, const void* device, size_t bytes) { memcpy(host, device, bytes); }
void eg_copy(float* dst, const float* src, long long floats) {
  memcpy(dst, src, sizeof *dst * (size_t)floats);
}

// Four rows of w at a time: x is read once for the four, and their four sums are
// independent chains of vector FMAs (one row's would wait on each add).
void eg_linear(const float* x, const float* w, const float* b, float* y, int out, int in) {
  const int blocks = (out + ROWS - 1) / ROWS;
#pragma omp parallel for schedule(static) if ((long long)out * in >= PARALLEL_MACS)
  for (int block = 0; block < blocks; ++block) {
    const int o = block * ROWS;
    if (o + ROWS <= out) {
      const float* w0 = w + (long long)o * in;
      const float *w1 = w0 + in, *w2 = w1 + in, *w3 = w2 + in;
      float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
      for (int i = 0; i < in; ++i) {
        const float v = x[i];
        a0 += v * w0[i];
        a1 += v * w1[i];
        a2 += v * w2[i];
        a3 += v * w3[i];
      }
      const float sums[ROWS] = {a0, a1, a2, a3};
      for (int r = 0; r < ROWS; ++r) y[o + r] = b ? sums[r] + b[o + r] : sums[r];
      continue;
    }
    for (int r = o; r < out; ++r) {   // the last rows, fewer than four
      const float* row = w + (long long)r * in;
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int i = 0; i < in; ++i) acc += x[i] * row[i];
      y[r] = b ? acc + b[r] : acc;
    }
  }
}
