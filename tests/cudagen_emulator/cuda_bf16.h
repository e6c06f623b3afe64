// The CPU stand-in for CUDA (tests/attention_emulator: threads as fibers, warp shuffles and
// __syncthreads as barriers), plus what the non-attention kernels need besides: block-
// shared arrays declared inside a kernel (one copy per kernel, as blocks run one at a
// time), rintf and the hardware sine and cosine.
#pragma once
#include "../attention_emulator/cuda_bf16.h"

#undef __shared__
#define __shared__ static

inline float __sinf(float x) { return std::sin(x); }
inline float __cosf(float x) { return std::cos(x); }
