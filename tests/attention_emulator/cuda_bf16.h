// A CPU stand-in for the CUDA that the attention kernels use, so that the generated kernels
// run unchanged (compiled by g++) in tests/test_attention_emulated.py on a machine without
// a GPU. Each CUDA thread of a block is a fiber (a stack of its own); the block's fibers run round
// robin, and every warp-collective operation (shuffle, ldmatrix, mma) and __syncthreads is
// a barrier among the fibers taking part. ldmatrix and mma follow the PTX ISA fragment
// tables, restated here independently of the kernels' own comments.
//
// It is included as <cuda_bf16.h> by the project's prelude (this folder is first on the
// include path), so it supplies the CUDA keywords and builtins too.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>
// Fibers switch stacks by the x86-64 code below, except where the binary may run under a
// shadow stack (-fcf-protection marks it for one): a switch would have to swap its
// return addresses too, as swapcontext does.
#if defined(__x86_64__) && !(defined(__CET__) && (__CET__ & 2))
#define EMU_SWITCH_STACK 1
#else
#include <ucontext.h>
#endif

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __shared__
#define __align__(n) __attribute__((aligned(n)))

struct uint3 { unsigned x, y, z; };
struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
inline float2 make_float2(float a, float b) { return {a, b}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
// Evict-first loads and stores are plain ones: the cache hint means nothing on the CPU.
template <typename T> inline void __stcs(T* p, T v) { *p = v; }
template <typename T> inline void __stwb(T* p, T v) { *p = v; }
template <typename T> inline T __ldcs(const T* p) { return *p; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __int_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }

struct __nv_bfloat16 { uint16_t bits; };
struct __nv_bfloat162 { __nv_bfloat16 x, y; };  // x at the lower address: the low half

inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  unsigned u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {(uint16_t)((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return {(uint16_t)(u >> 16)};
}
inline float __bfloat162float(__nv_bfloat16 b) { return __uint_as_float((unsigned)b.bits << 16); }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
  return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)};
}
inline float2 __bfloat1622float2(__nv_bfloat162 v) {
  return {__bfloat162float(v.x), __bfloat162float(v.y)};
}

// ---- switching stacks --------------------------------------------------------------------
namespace emu {

// A switch pushes the callee-saved registers on the stack it leaves and pops them from the
// one it enters (nothing changes the floating-point control words, so they stay put). glibc's
// swapcontext also saves the signal mask, a system call a switch, which took most of an
// emulated run's time; it serves where this x86-64 code does not.
#ifdef EMU_SWITCH_STACK
struct Context { void* sp = nullptr; };
extern "C" void emu_switch_stack(void** save, void* load);
asm(R"(
  .pushsection .text
  .p2align 4
  .type emu_switch_stack, @function
emu_switch_stack:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size emu_switch_stack, . - emu_switch_stack
  .popsection
)");
inline void switch_to(Context& from, Context& to) { emu_switch_stack(&from.sp, to.sp); }
// A context whose first switch enters start() on the stack, as a call would: the return
// address (none: start never returns) at a 16-byte boundary, then what the switch pops.
inline void prepare(Context& c, char* stack, size_t size, void (*start)()) {
  void** sp = reinterpret_cast<void**>(reinterpret_cast<uintptr_t>(stack + size) & ~uintptr_t{15});
  *--sp = nullptr;
  *--sp = reinterpret_cast<void*>(start);
  for (int r = 0; r < 6; ++r) *--sp = nullptr;
  c.sp = sp;
}
#else
struct Context { ucontext_t uc; };
inline void switch_to(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
inline void prepare(Context& c, char* stack, size_t size, void (*start)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = size;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, start, 0);
}
#endif

// ---- fibers: one per CUDA thread of the running block -------------------------------------
constexpr size_t STACK = 1 << 18;

// Thread t's stack, kept from block to block (a block's fibers have all ended before the
// next one's start).
inline char* stack(int t) {
  static std::vector<std::unique_ptr<char[]>> stacks;
  while ((int)stacks.size() <= t) stacks.emplace_back(new char[STACK]);
  return stacks[t].get();
}

struct Fiber {
  Context ctx;
  uint3 tid;
  long long warp_gen = 0, block_gen = 0;
  bool done = false;
};

struct Block {
  std::vector<Fiber> fibers;
  std::vector<long long> warp_arrived;  // per warp, monotonically increasing
  long long block_arrived = 0;
  // Per warp and lane, what a collective operation exchanges.
  struct Slot { const void* ptr; unsigned u[6]; float g; };
  std::vector<Slot> slots;
  int current = 0;
  Context main;
  std::function<void()> body;
};

inline Block*& block() { static Block* b = nullptr; return b; }
inline Fiber& self() { return block()->fibers[block()->current]; }
inline void yield() { Block* b = block(); switch_to(b->fibers[b->current].ctx, b->main); }

inline int lane() { return (int)(self().tid.x & 31); }
inline int warp() { return (int)(self().tid.x >> 5); }
inline Block::Slot& slot(int w, int l) { return block()->slots[w * 32 + l]; }

inline void warp_barrier() {
  Block* b = block();
  const int w = warp();
  const long long gen = ++self().warp_gen;
  ++b->warp_arrived[w];
  while (b->warp_arrived[w] < 32 * gen) yield();
}

inline void block_barrier() {
  Block* b = block();
  const long long gen = ++self().block_gen;
  ++b->block_arrived;
  while (b->block_arrived < (long long)b->fibers.size() * gen) yield();
}

inline void entry() {
  block()->body();
  self().done = true;
  yield();  // never resumed
}

}  // namespace emu

inline dim3& emu_grid() { static dim3 d; return d; }
inline dim3& emu_block_idx() { static dim3 d; return d; }
inline dim3& emu_block_dim() { static dim3 d; return d; }
#define threadIdx (emu::self().tid)
#define blockIdx (emu_block_idx())
#define blockDim (emu_block_dim())
#define gridDim (emu_grid())

inline void __syncthreads() { emu::block_barrier(); }
// Blocks run one after another, so memory is always coherent: the fence, the read-only
// and the L2 loads are plain, and an atomic needs no lock.
inline void __threadfence() {}
template <typename T> inline T __ldcg(const T* p) { return *p; }
template <typename T> inline T __ldg(const T* p) { return *p; }
inline int atomicAdd(int* p, int v) { const int old = *p; *p = old + v; return old; }

// A shuffle: every lane of the warp posts v, then reads lane src's.
template <typename T>
inline T emu_shfl(T v, int src) {
  static_assert(sizeof(T) == 4, "32-bit shuffles only");
  const int w = emu::warp(), l = emu::lane();
  std::memcpy(&emu::slot(w, l).g, &v, 4);
  emu::warp_barrier();
  T out;
  std::memcpy(&out, &emu::slot(w, src & 31).g, 4);
  emu::warp_barrier();
  return out;
}
template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int mask) { return emu_shfl(v, emu::lane() ^ mask); }
template <typename T>
inline T __shfl_sync(unsigned, T v, int src) { return emu_shfl(v, src); }

// Run a kernel over a grid, one block after another. Not a template: every block holds the
// kernel as a std::function anyway, and a copy of this loop for each launch site cost a
// second of an attention runner's build.
inline void emu_launch(dim3 grid, dim3 block, const std::function<void()>& kernel) {
  emu_grid() = grid;
  emu_block_dim() = block;
  const int n = (int)(block.x * block.y * block.z);
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        emu_block_idx() = dim3(x, y, z);
        emu::Block b;
        b.fibers.resize(n);
        b.warp_arrived.assign((n + 31) / 32, 0);
        b.slots.resize(((n + 31) / 32) * 32);
        b.body = kernel;
        emu::block() = &b;
        for (int t = 0; t < n; ++t) {
          emu::Fiber& f = b.fibers[t];
          f.tid = {(unsigned)t, 0, 0};
          emu::prepare(f.ctx, emu::stack(t), emu::STACK, emu::entry);
        }
        for (int live = n; live > 0;) {
          live = 0;
          for (int t = 0; t < n; ++t) {
            if (b.fibers[t].done) continue;
            b.current = t;
            emu::switch_to(b.main, b.fibers[t].ctx);
            live += !b.fibers[t].done;
          }
        }
        emu::block() = nullptr;
      }
}
