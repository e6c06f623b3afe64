// sample.c: the draw of sample.h.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "error.h"
#include "sample.h"

struct Sampler {
  int vocab;
  double* w;     // each id's weight
  float* sorted; // scratch: the logits, for the top_k-th
  int* live;     // scratch: the ids of non-zero weight, largest logit first
};

static uint64_t mix(uint64_t z) {   // splitmix64's finaliser
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

double sampler_uniform(uint64_t seed, int step, int row) {
  const uint64_t base = mix(mix(seed) ^ (uint64_t)step);
  return (double)(mix(base ^ (uint64_t)row) >> 11) * 0x1.0p-53;
}

Sampler* sampler_new(int vocab) {
  Sampler* s = malloc(sizeof *s);
  if (!s) eg_fail("sampler: out of memory");
  s->vocab = vocab;
  s->w = malloc(sizeof *s->w * (size_t)vocab);
  s->sorted = malloc(sizeof *s->sorted * (size_t)vocab);
  s->live = malloc(sizeof *s->live * (size_t)vocab);
  if (!s->w || !s->sorted || !s->live) eg_fail("sampler: out of memory");
  return s;
}

// The k-th largest of a[0 … n-1] (k from 1, equal values counted each), reordering a.
static float kth_largest(float* a, int n, int k) {
  int lo = 0, hi = n - 1;
  const int want = n - k;   // its place in ascending order
  while (lo < hi) {
    const float pivot = a[(lo + hi) / 2];
    int i = lo, j = hi;
    while (i <= j) {
      while (a[i] < pivot) ++i;
      while (a[j] > pivot) --j;
      if (i <= j) {
        const float t = a[i];
        a[i++] = a[j];
        a[j--] = t;
      }
    }
    if (want <= j) hi = j;
    else if (want >= i) lo = i;
    else break;
  }
  return a[want];
}

static const float* by_logit;   // qsort's comparison reads the logits here

static int larger_first(const void* a, const void* b) {
  const float x = by_logit[*(const int*)a], y = by_logit[*(const int*)b];
  return x > y ? -1 : x < y;
}

// Zero the weights of the ids outside the nucleus: those whose strictly larger logits
// already weigh top_p of the total.
static void nucleus(Sampler* s, const float* x, float top_p) {
  double total = 0;
  int n = 0;
  for (int i = 0; i < s->vocab; ++i)
    if (s->w[i] != 0) {
      total += s->w[i];
      s->live[n++] = i;
    }
  by_logit = x;
  qsort(s->live, (size_t)n, sizeof *s->live, larger_first);
  const double limit = (double)top_p * total;
  double above = 0;
  for (int g = 0; g < n;) {
    int end = g;
    double mass = 0;
    while (end < n && x[s->live[end]] == x[s->live[g]]) mass += s->w[s->live[end++]];
    if (above >= limit)
      for (int i = g; i < end; ++i) s->w[s->live[i]] = 0;
    above += mass;
    g = end;
  }
}

int sampler_pick(Sampler* s, const float* x, double u, const Settings* settings) {
  const int vocab = s->vocab;
  int best = 0;
  for (int i = 1; i < vocab; ++i)
    if (x[i] > x[best]) best = i;
  if (settings->temperature == 0.0f) return best;
  const double top = x[best], temperature = settings->temperature;
  for (int i = 0; i < vocab; ++i)   // NaN takes no part
    s->w[i] = x[i] == x[i] ? rint(exp(((double)x[i] - top) / temperature) * 4294967296.0) : 0;
  if (settings->top_k > 0 && settings->top_k < vocab) {
    memcpy(s->sorted, x, sizeof *x * (size_t)vocab);
    const float kth = kth_largest(s->sorted, vocab, settings->top_k);
    for (int i = 0; i < vocab; ++i)
      if (x[i] < kth) s->w[i] = 0;
  }
  if (settings->top_p < 1.0f) nucleus(s, x, settings->top_p);
  uint64_t total = 0;
  for (int i = 0; i < vocab; ++i) total += (uint64_t)s->w[i];
  const uint64_t target = (uint64_t)floor(u * (double)total);
  uint64_t run = 0;
  for (int i = 0; i < vocab; ++i) {
    run += (uint64_t)s->w[i];
    if (run > target) return i;
  }
  return best;
}
