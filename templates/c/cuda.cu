// cuda.cu: the backend (backend.h) on a GPU, for `make cuda`: device memory, and the linear
// layers' matrix-vector product, a warp a row of the weight (hand-written: a GEMV of one
// token is bound by reading the weight once, which this does with 16-byte loads). It
// sums in float32 and adds the bias after, as `eulergen sample`'s fp32 decoder does.
// Everything runs on the default stream, in order.
#include <cstdio>
#include <cstdlib>

#include <cuda_runtime.h>

#include "backend.h"
#include "error.h"

enum { GEMV_THREADS = 256, WARP = 32 };

static void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) eg_fail("cuda: %s: %s", what, cudaGetErrorString(err));
}

const char* eg_backend(void) {
  static char name[300];
  cudaDeviceProp prop;
  check(cudaGetDeviceProperties(&prop, 0), "no GPU");
  snprintf(name, sizeof name, "cuda, %s", prop.name);
  return name;
}

void* eg_alloc(size_t bytes) {
  void* p = nullptr;
  check(cudaMalloc(&p, bytes), "cudaMalloc");
  check(cudaMemset(p, 0, bytes), "cudaMemset");
  return p;
}

const float* eg_weights(float* host, long long floats) {
  float* device = static_cast<float*>(eg_alloc(sizeof(float) * floats));
  eg_upload(device, host, sizeof(float) * floats);
  free(host);
  return device;
}

void eg_upload(void* device, const void* host, size_t bytes) {
  check(cudaMemcpy(device, host, bytes, cudaMemcpyHostToDevice), "upload");
}

void eg_download(void* host, const void* device, size_t bytes) {
  check(cudaMemcpy(host, device, bytes, cudaMemcpyDeviceToHost), "download");
}

void eg_copy(float* dst, const float* src, long long floats) {
  check(cudaMemcpyAsync(dst, src, sizeof(float) * floats, cudaMemcpyDeviceToDevice), "copy");
}

// y[o] = w[o, :] · x (+ b[o]): warp o reads row o, its lanes 16 bytes at a time where the
// row and x allow it, then sums across the warp.
__global__ void __launch_bounds__(GEMV_THREADS) eg_gemv(const float* __restrict__ x,
    const float* __restrict__ w, const float* __restrict__ b, float* __restrict__ y, int out,
    int in) {
  const int row = (int)((blockIdx.x * (long long)blockDim.x + threadIdx.x) / WARP);
  const int lane = threadIdx.x % WARP;
  if (row >= out) return;
  const float* wr = w + (long long)row * in;
  float acc = 0.0f;
  if (in % 4 == 0 && ((reinterpret_cast<unsigned long long>(wr) |
                       reinterpret_cast<unsigned long long>(x)) & 15) == 0) {
    const float4* w4 = reinterpret_cast<const float4*>(wr);
    const float4* x4 = reinterpret_cast<const float4*>(x);
    for (int i = lane; i < in / 4; i += WARP) {
      const float4 a = w4[i], v = x4[i];
      acc += a.x * v.x + a.y * v.y + a.z * v.z + a.w * v.w;
    }
  } else {
    for (int i = lane; i < in; i += WARP) acc += wr[i] * x[i];
  }
  for (int offset = WARP / 2; offset; offset /= 2)
    acc += __shfl_down_sync(0xffffffffu, acc, offset);
  if (lane == 0) y[row] = b ? acc + b[row] : acc;
}

void eg_linear(const float* x, const float* w, const float* b, float* y, int out, int in) {
  const int rows_a_block = GEMV_THREADS / WARP;
  eg_gemv<<<(out + rows_a_block - 1) / rows_a_block, GEMV_THREADS>>>(x, w, b, y, out, in);
  check(cudaGetLastError(), "eg_linear");
}
