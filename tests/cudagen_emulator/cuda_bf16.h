// The CPU stand-in for CUDA (tests/attention_emulator: threads as fibers, warp shuffles and
// __syncthreads as barriers), plus what the non-attention kernels need besides: block-
// shared arrays declared inside a kernel (one copy per kernel, as blocks run one at a
// time), rintf, the hardware sine and cosine, and atomicMax (the embedding's merge: fibers
// switch only at barriers, so an atomic needs no lock, as atomicAdd in the base).
#pragma once
#include "../attention_emulator/cuda_bf16.h"

#undef __shared__
#define __shared__ static

inline float __sinf(float x) { return std::sin(x); }
inline float __cosf(float x) { return std::cos(x); }
inline int atomicMax(int* p, int v) { const int old = *p; *p = old > v ? old : v; return old; }

// A 2-D block (the fixed-order weight-gradient reduce): thread t is (t % x, t / x). Only
// for kernels without warp collectives, which the base emulator keys on threadIdx.x.
template <typename F>
void emu_launch_2d(dim3 grid, dim3 block, F&& kernel) {
  const unsigned n = block.x * block.y;
  emu_launch(grid, dim3(n), [&] {
    const unsigned t = emu::self().tid.x;
    emu::self().tid = {t % block.x, t / block.x, 0};
    emu_block_dim() = block;
    kernel();
  });
}

// A device-side fault (the embedding kernels' id check): the launch ends, as on the GPU.
[[noreturn]] inline void __trap() {
  std::fflush(stdout);
  std::abort();
}
