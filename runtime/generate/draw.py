"""Drawing the next token from the last position's logits, on the device and in numpy.

    u = uniforms(seed, step, rows)                       # one number per row and step
    tokens = pick(logits, vocab, u, temperature, top_k, top_p)    # the numpy reference
    Draw(backend, logits, vocab, next_ids, drawn, live)  # a tape node: the same on the GPU

The rule, the same on both (ids ≥ vocab, the padded rows, never take part):
- temperature 0: the most likely id (the lowest of equal ones);
- else weights w = rint(exp((x - max) / temperature) · 2^32) as integers (float64 exp),
  zero below the top_k-th largest logit (ties kept), then zero wherever the weight of
  the strictly larger logits already reaches top_p of the total (the nucleus: the first
  id always stays, equal logits stay together);
- the id is the first whose running sum of w (in id order) passes floor(u · Σw).
Integer weights make the sums exact in any order, so the kernel's block reductions give
the numpy sums' bits and a seed gives the same draws run after run. What is not bitwise:
the device's exp against numpy's (either may be off by an ulp, which moves a weight by
one unit in 2^32 rarely), so the two paths pick different ids only when u falls on such a
boundary; greedy picks agree exactly given the same logits.

u is a counter-based hash of (seed, step, row) (splitmix64, 53 bits), computed the same
way in both, so no generator state lives on the device and a captured step draws anew at
each replay from its `step` argument alone (runtime/engine/cuda_graph.py patches it).
"""
from __future__ import annotations

import numpy as np

from eulergen.launch import Launch

MASK = (1 << 64) - 1
_GOLDEN, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
THREADS = 1024


def _mix(z: int) -> int:
    z = (z + _GOLDEN) & MASK
    z = ((z ^ (z >> 30)) * _M1) & MASK
    z = ((z ^ (z >> 27)) * _M2) & MASK
    return z ^ (z >> 31)


def uniforms(seed: int, step: int, rows: int) -> np.ndarray:
    """[rows] float64 in [0, 1): the draw of each row at `step` for `seed`."""
    base = _mix(_mix(seed & MASK) ^ (step & MASK))
    return np.array([(_mix(base ^ r) >> 11) * 2.0 ** -53 for r in range(rows)])


def pick(logits: np.ndarray, vocab: int, u: np.ndarray, temperature: float,
         top_k: int | None, top_p: float | None) -> np.ndarray:
    """One id per row of host logits [B, ≥ vocab] by the module's rule (u: uniforms)."""
    x = logits[:, :vocab]
    if temperature == 0:
        return np.argmax(x, axis=1)
    tokens = np.empty(len(x), dtype=np.int64)
    for r, v in enumerate(x):
        d = (v.astype(np.float64) - np.float64(v.max())) / np.float64(np.float32(temperature))
        w = np.rint(np.exp(d) * 2.0 ** 32)
        if top_k and top_k < vocab:
            w[v < np.partition(v, -top_k)[-top_k]] = 0
        if top_p is not None and top_p < 1:
            live = np.flatnonzero(w)
            values, group = np.unique(v[live], return_inverse=True)
            mass = np.bincount(group, weights=w[live], minlength=len(values))
            above = mass[::-1].cumsum()[::-1] - mass      # the weight of strictly larger logits
            limit = np.float64(np.float32(top_p)) * w.sum()
            w[live[above[group] >= limit]] = 0
        cdf = np.cumsum(w.astype(np.uint64))
        target = np.floor(u[r] * np.float64(cdf[-1]))
        tokens[r] = np.searchsorted(cdf, np.uint64(target), side="right")
    return tokens


# One block of THREADS a row. Keys order floats as their bits do (sign flipped); the
# top_k-th key and the nucleus cut are found by radix select over 4 bytes, counting in
# shared memory with integer atomics (exact, so the order does not matter); the draw
# scans chunks of the row in id order. NaN logits take no part.
SOURCE = r"""
typedef unsigned long long u64;
#define NT 1024
__device__ __forceinline__ u64 eg_mix(u64 z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
__device__ __forceinline__ unsigned eg_key(float x) {
  const unsigned u = __float_as_uint(x + 0.0f);   // -0 counts as +0
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

extern "C" __global__ void __launch_bounds__(NT) eg_draw(
    const float* __restrict__ logits, long long row_stride, int vocab, float temperature,
    int top_k, float top_p, u64 seed, int step, int* __restrict__ next_ids,
    int* __restrict__ drawn, int drawn_stride, int column) {
  __shared__ float s_best[32];
  __shared__ int s_arg[32];
  __shared__ unsigned s_cnt[256];
  __shared__ u64 s_mass[256];
  __shared__ u64 s_scan[NT];
  __shared__ unsigned s_digit;
  __shared__ u64 s_carry;
  const int row = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const float* x = logits + row * row_stride;

  // the largest logit and its lowest id
  float best = __int_as_float(0xff800000);
  int arg = vocab;
  for (int i = tid; i < vocab; i += NT) {
    const float v = x[i];
    if (v > best) { best = v; arg = i; }
  }
  for (int o = 16; o; o >>= 1) {
    const float b = __shfl_down_sync(0xffffffffu, best, o);
    const int a = __shfl_down_sync(0xffffffffu, arg, o);
    if (b > best || (b == best && a < arg)) { best = b; arg = a; }
  }
  if (lane == 0) { s_best[warp] = best; s_arg[warp] = arg; }
  __syncthreads();
  if (tid == 0) {
    for (int w = 1; w < NT / 32; ++w)
      if (s_best[w] > s_best[0] || (s_best[w] == s_best[0] && s_arg[w] < s_arg[0])) {
        s_best[0] = s_best[w];
        s_arg[0] = s_arg[w];
      }
  }
  __syncthreads();
  const float top = s_best[0];
  if (temperature <= 0.0f) {
    if (tid == 0) {
      const int id = s_arg[0] < vocab ? s_arg[0] : 0;
      next_ids[row] = id;
      drawn[row * drawn_stride + column] = id;
    }
    return;
  }

  // the top_k-th largest key (0: every id stays)
  unsigned kth = 0;
  if (top_k > 0 && top_k < vocab) {
    unsigned prefix = 0, mask = 0, want = top_k;
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int d = tid; d < 256; d += NT) s_cnt[d] = 0;
      __syncthreads();
      for (int i = tid; i < vocab; i += NT) {
        const float v = x[i];
        const unsigned k = eg_key(v);
        if (v == v && (k & mask) == prefix) atomicAdd(&s_cnt[(k >> shift) & 255u], 1u);
      }
      __syncthreads();
      if (tid == 0) {
        unsigned seen = 0;
        int d = 255;
        for (; d > 0 && seen + s_cnt[d] < want; --d) seen += s_cnt[d];
        s_digit = d;
        s_carry = want - seen;
      }
      __syncthreads();
      prefix |= s_digit << shift;
      mask |= 255u << shift;
      want = (unsigned)s_carry;
      __syncthreads();
    }
    kth = prefix;
  }
  auto weight = [&](float v, unsigned cut) -> u64 {
    if (!(v == v) || eg_key(v) < cut || eg_key(v) < kth) return 0ull;
    return __double2ull_rn(exp(((double)v - (double)top) / (double)temperature) * 4294967296.0);
  };
  auto block_sum = [&](u64 s) -> u64 {
    s_scan[tid] = s;
    __syncthreads();
    for (int n = NT / 2; n; n >>= 1) {
      if (tid < n) s_scan[tid] += s_scan[tid + n];
      __syncthreads();
    }
    const u64 total = s_scan[0];
    __syncthreads();
    return total;
  };
  u64 mine = 0;
  for (int i = tid; i < vocab; i += NT) mine += weight(x[i], 0u);
  u64 total = block_sum(mine);

  // the nucleus: the lowest key whose strictly larger keys weigh less than top_p of it
  unsigned cut = 0;
  if (top_p < 1.0f) {
    const double limit = (double)top_p * (double)total;
    unsigned prefix = 0, mask = 0;
    u64 above = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int d = tid; d < 256; d += NT) { s_cnt[d] = 0; s_mass[d] = 0; }
      __syncthreads();
      for (int i = tid; i < vocab; i += NT) {
        const float v = x[i];
        const u64 w = weight(v, 0u);
        const unsigned k = eg_key(v);
        if (w && (k & mask) == prefix) {
          atomicAdd(&s_cnt[(k >> shift) & 255u], 1u);
          atomicAdd(&s_mass[(k >> shift) & 255u], w);
        }
      }
      __syncthreads();
      if (tid == 0) {
        u64 s = above, at = above;
        int digit = 255;
        for (int d = 255; d >= 0; --d) {
          if (!s_cnt[d]) continue;
          if ((double)s >= limit) break;
          digit = d;
          at = s;
          s += s_mass[d];
        }
        s_digit = digit;
        s_carry = at;
      }
      __syncthreads();
      prefix |= s_digit << shift;
      mask |= 255u << shift;
      above = s_carry;
      __syncthreads();
    }
    cut = prefix;
    mine = 0;
    for (int i = tid; i < vocab; i += NT) mine += weight(x[i], cut);
    total = block_sum(mine);
  }

  // the draw: the first id whose running sum passes floor(u * total), chunks in id order
  const u64 base = eg_mix(eg_mix(seed) ^ (u64)(unsigned)step);
  const double u = (double)(eg_mix(base ^ (u64)row) >> 11) * 0x1.0p-53;
  const u64 target = (u64)floor(u * (double)total);
  const int chunk = (vocab + NT - 1) / NT, lo = min(vocab, tid * chunk), hi = min(vocab, lo + chunk);
  mine = 0;
  for (int i = lo; i < hi; ++i) mine += weight(x[i], cut);
  s_scan[tid] = mine;
  __syncthreads();
  for (int n = 1; n < NT; n <<= 1) {   // inclusive scan
    const u64 add = tid >= n ? s_scan[tid - n] : 0ull;
    __syncthreads();
    s_scan[tid] += add;
    __syncthreads();
  }
  u64 run = s_scan[tid] - mine;
  if (run <= target && target < s_scan[tid]) {
    for (int i = lo; i < hi; ++i) {
      run += weight(x[i], cut);
      if (run > target) {
        next_ids[row] = i;
        drawn[row * drawn_stride + column] = i;
        break;
      }
    }
  }
}
"""
NAMES = ("logits", "row_stride", "vocab", "temperature", "top_k", "top_p", "seed", "step",
         "next_ids", "drawn", "drawn_stride", "column")

_kernel: list = []


class Draw:
    """The draw as a tape node, after the head: logits [B, vocab_rows] (float32 on the
    GPU) -> next_ids [B] (the next step's input) and drawn[:, live['column']], with the
    settings and the step read from `live` when it runs (a captured one: at each replay)."""

    def __init__(self, backend, logits, vocab: int, next_ids, drawn, live: dict):
        self.backend, self.logits, self.vocab = backend, logits, vocab
        self.next_ids, self.drawn, self.live = next_ids.reshape(-1), drawn, live

    def forward(self, tape) -> None:
        live = self.live
        if not self.backend.is_gpu:
            u = uniforms(live["seed"], live["step"], len(self.next_ids))
            tokens = pick(self.logits, self.vocab, u, live["temperature"], live["top_k"],
                          live["top_p"])
            self.next_ids[...] = tokens
            self.drawn[:, live["column"]] = tokens
            return
        from eulergen.runtime.engine.kernels import launch
        if not _kernel:
            import cupy
            _kernel.append(cupy.RawKernel(SOURCE, "eg_draw", options=("-std=c++17",)))
        args = (self.logits, np.int64(self.logits.shape[1]), np.int32(self.vocab),
                np.float32(live["temperature"]), np.int32(live["top_k"] or 0),
                np.float32(live["top_p"] or 1.0), np.uint64(live["seed"] & MASK),
                np.int32(live["step"]), self.next_ids, self.drawn,
                np.int32(self.drawn.shape[1]), np.int32(live["column"]))
        launch(_kernel[0], Launch((len(self.next_ids),), (THREADS,)), args, NAMES)
