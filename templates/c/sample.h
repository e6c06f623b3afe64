// sample.h: the draw of the next token from the last position's logits, by eulergen's rule
// (runtime/generate/draw.py; hand-written, not derived from a spec), so that a seed draws
// the tokens `eulergen sample` draws from the same logits:
//   temperature 0: the most likely id (the lowest of equal ones);
//   else integer weights w = rint(exp((x - max) / temperature) · 2^32) (double exp), zero
//   below the top_k-th largest logit (ties kept), then zero wherever the weight of the
//   strictly larger logits already reaches top_p of the total (the nucleus); the id is the
//   first whose running sum of w (in id order) passes floor(u · Σw), u a splitmix64 hash of
//   (seed, step, row). Integer weights make every sum exact.
#pragma once

#include <stdint.h>

typedef struct {
  float temperature;   // 0: greedy
  int top_k;           // 0: every id
  float top_p;         // 1: every id
  uint64_t seed;
} Settings;

typedef struct Sampler Sampler;

Sampler* sampler_new(int vocab);
// u in [0, 1): the draw of `row` at `step` for `seed`.
double sampler_uniform(uint64_t seed, int step, int row);
// The id drawn from logits[0 … vocab - 1] with u.
int sampler_pick(Sampler* s, const float* logits, double u, const Settings* settings);
