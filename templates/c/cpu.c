// cpu.c: the backend (backend.h) on the CPU, for `make cpu`: memory is the host's, and a
// linear layer's product is a dot product a row of its weight, the rows over OpenMP's
// threads where the program is built with it (make cpu OPENMP=1) and the layer is large
// enough to pay for them.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "backend.h"
#include "error.h"

enum { PARALLEL_MACS = 1 << 20 };   // below this a layer runs on one thread: the threads cost more

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

void eg_linear(const float* x, const float* w, const float* b, float* y, int out, int in) {
#pragma omp parallel for schedule(static) if ((long long)out * in >= PARALLEL_MACS)
  for (int o = 0; o < out; ++o) {
    const float* row = w + (long long)o * in;
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int i = 0; i < in; ++i) acc += x[i] * row[i];
    y[o] = b ? acc + b[o] : acc;
  }
}
