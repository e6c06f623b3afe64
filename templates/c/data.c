// data.c: the token files and the batch order (data.h). The order is numpy's:
// default_rng(words) is a SeedSequence of the words' 32-bit pieces (numpy's
// bit_generator.pyx: its pool of 4 words, mixed by hashmix and mix, then 8 words drawn from
// it) seeding a PCG64 (XSL-RR 128/64, numpy's pcg64.c); permutation(n) is the Fisher-Yates
// shuffle of 0 … n - 1 from the last place down, each place's pick by masked rejection
// (numpy's random_interval: 32-bit draws, two from each 64-bit one, below 2^32).
#include <stdlib.h>
#include <string.h>

#include "data.h"
#include "error.h"
#include "files.h"

__extension__ typedef unsigned __int128 u128;

enum { HEADER_INTS = 256, POOL = 4, STATE_WORDS = 8 };
static const uint32_t INIT_A = 0x43b0d7e5u, MULT_A = 0x931e8875u, INIT_B = 0x8b51f9ddu,
                      MULT_B = 0x58f38dedu, MIX_L = 0xca01f9ddu, MIX_R = 0x4973f715u;
#define PCG_MULT (((u128)2549297995355413924ULL << 64) + 4865540595714422341ULL)

static uint32_t hashmix(uint32_t value, uint32_t* hash) {
  value ^= *hash;
  *hash *= MULT_A;
  value *= *hash;
  return value ^ value >> 16;
}

static uint32_t mix(uint32_t x, uint32_t y) {
  const uint32_t r = MIX_L * x - MIX_R * y;
  return r ^ r >> 16;
}

typedef struct {
  u128 state, inc;
  int has32;
  uint32_t next32;
} Pcg64;

static void pcg_step(Pcg64* r) { r->state = r->state * PCG_MULT + r->inc; }

static uint64_t pcg_next64(Pcg64* r) {
  pcg_step(r);
  const uint64_t x = (uint64_t)(r->state >> 64) ^ (uint64_t)r->state;
  const unsigned rot = (unsigned)(r->state >> 122);
  return x >> rot | x << (-rot & 63);
}

static uint32_t pcg_next32(Pcg64* r) {
  if (r->has32) {
    r->has32 = 0;
    return r->next32;
  }
  const uint64_t v = pcg_next64(r);
  r->has32 = 1;
  r->next32 = (uint32_t)(v >> 32);
  return (uint32_t)v;
}

// default_rng(words): the SeedSequence's state of 4 64-bit words seeds PCG64
static void seeded(Pcg64* r, const uint64_t* words, int count) {
  uint32_t entropy[64], pool[POOL], hash = INIT_A;
  int n = 0;
  for (int i = 0; i < count; ++i) {   // each integer as its 32-bit pieces, low first; 0 as one
    uint64_t w = words[i];
    do {
      if (n == 64) eg_fail("a seed of more than 64 words");
      entropy[n++] = (uint32_t)w;
      w >>= 32;
    } while (w);
  }
  for (int i = 0; i < POOL; ++i) pool[i] = hashmix(i < n ? entropy[i] : 0, &hash);
  for (int src = 0; src < POOL; ++src)
    for (int dst = 0; dst < POOL; ++dst)
      if (src != dst) pool[dst] = mix(pool[dst], hashmix(pool[src], &hash));
  for (int src = POOL; src < n; ++src)
    for (int dst = 0; dst < POOL; ++dst) pool[dst] = mix(pool[dst], hashmix(entropy[src], &hash));
  uint32_t state[STATE_WORDS];
  hash = INIT_B;
  for (int i = 0; i < STATE_WORDS; ++i) {
    uint32_t v = pool[i % POOL] ^ hash;
    hash *= MULT_B;
    v *= hash;
    state[i] = v ^ v >> 16;
  }
  uint64_t s[4];
  for (int i = 0; i < 4; ++i) s[i] = state[2 * i] | (uint64_t)state[2 * i + 1] << 32;
  r->state = 0;
  r->inc = ((((u128)s[2] << 64) | s[3]) << 1) | 1;
  pcg_step(r);
  r->state += ((u128)s[0] << 64) | s[1];
  pcg_step(r);
  r->has32 = 0;
}

static uint64_t interval(Pcg64* r, uint64_t max) {
  if (max == 0) return 0;
  uint64_t mask = max, v;
  for (int shift = 1; shift <= 32; shift *= 2) mask |= mask >> shift;
  if (max <= 0xffffffffULL)
    while ((v = pcg_next32(r) & mask) > max) continue;
  else
    while ((v = pcg_next64(r) & mask) > max) continue;
  return v;
}

void data_permutation(const uint64_t* words, int count, long long n, long long* out) {
  Pcg64 r;
  seeded(&r, words, count);
  for (long long i = 0; i < n; ++i) out[i] = i;
  for (long long i = n - 1; i > 0; --i) {
    const long long j = (long long)interval(&r, (uint64_t)i), t = out[i];
    out[i] = out[j];
    out[j] = t;
  }
}

// -- the files -----------------------------------------------------------------------

// llm.c's other binary files, named so that a mistaken one says what it is
static const struct { int32_t magic; const char* what; } LLMC_FILES[] = {
    {20240326, "a model checkpoint"}, {20240327, "a model debug state"},
    {20240328, "a tokenizer file"}, {20240522, "an eval (HellaSwag) file"}};

// Whether a name is llm.c's for a shard (<name>_train_000001.bin): such a file has a header.
static int shard_name(const char* path) {
  const size_t n = strlen(path);
  if (n < 4 || strcmp(path + n - 4, ".bin") != 0) return 0;
  size_t i = n - 4;
  while (i > 0 && path[i - 1] >= '0' && path[i - 1] <= '9') --i;
  if (i == n - 4) return 0;
  if (i > 0 && path[i - 1] == '_') --i;
  for (int k = 0; k < 2; ++k) {
    const char* word = k ? "_val" : "_train";
    const size_t w = strlen(word);
    if (i >= w && strncmp(path + i - w, word, w) == 0) return 1;
  }
  return 0;
}

static void open_file(TokenFile* t, const char* path, int vocab) {
  long long size;
  FILE* f = eg_open(path, &size);
  int32_t head[HEADER_INTS] = {0};
  eg_read_at(f, path, head, size < HEADER_INTS * 4 ? size / 4 * 4 : HEADER_INTS * 4, 0);
  const int32_t magic = size >= 4 ? head[0] : 0;
  long long at = 0, width = 2;
  if (magic == 20240520 || magic == 20240801) {
    const int version = magic == 20240520 ? 1 : 7;
    width = magic == 20240520 ? 2 : 4;
    if (size < HEADER_INTS * 4)
      eg_fail("%s: truncated: %lld bytes, shorter than the %d-byte header", path, size,
              HEADER_INTS * 4);
    if (head[1] != version)
      eg_fail("%s: header version %d is not supported under magic %d (expected %d)", path,
              head[1], magic, version);
    const long long body = (size - HEADER_INTS * 4) / width;
    if (head[2] < 0 || body < head[2])
      eg_fail("%s: truncated: header says %d tokens, body holds %lld", path, head[2], body);
    if (body > head[2])
      eg_fail("%s: header says %d tokens but the body holds %lld: not a shard this loader "
              "wrote or knows", path, head[2], body);
    if (head[2] == 0) eg_fail("%s: shard holds no tokens", path);
    t->count = head[2];
    at = HEADER_INTS * 4;
  } else {
    for (size_t i = 0; i < sizeof LLMC_FILES / sizeof *LLMC_FILES; ++i)
      if (magic == LLMC_FILES[i].magic)
        eg_fail("%s: header magic %d is %s, not a token shard (expected 20240520 or 20240801)",
                path, magic, LLMC_FILES[i].what);
    if (shard_name(path))
      eg_fail("%s: header magic %d is not an llm.c token shard (expected 20240520 or "
              "20240801)", path, magic);
    if (size % 2)
      eg_fail("%s: truncated: %lld bytes is not a whole number of uint16 tokens (read as a "
              "headerless nanoGPT .bin)", path, size);
    if (size == 0) eg_fail("%s: empty token file", path);
    t->count = size / 2;
  }
  unsigned char* raw = malloc((size_t)(t->count * width));
  t->tokens = malloc(sizeof *t->tokens * (size_t)t->count);
  if (!raw || !t->tokens) eg_fail("%s: out of memory for %lld tokens", path, t->count);
  eg_read_at(f, path, raw, t->count * width, at);
  fclose(f);
  for (long long i = 0; i < t->count; ++i) {   // little-endian
    const unsigned char* b = raw + i * width;
    t->tokens[i] = width == 2 ? (uint32_t)(b[0] | b[1] << 8)
                              : (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 |
                                    (uint32_t)b[3] << 24;
    if (t->tokens[i] >= (uint32_t)vocab)
      eg_fail("%s: token id %u is outside the model's vocabulary (model.vocab_size %d); was "
              "this data made with another tokenizer?", path, t->tokens[i], vocab);
  }
  free(raw);
  t->path = path;
}

void data_open(Data* d, const char* const* paths, int count, int batch, int seq,
               uint64_t seed, int vocab) {
  memset(d, 0, sizeof *d);
  d->files = calloc((size_t)count, sizeof *d->files);
  d->order = malloc(sizeof *d->order * (size_t)count);
  if (!d->files || !d->order) eg_fail("out of memory");
  d->count = count;
  d->batch = batch;
  d->seq = seq;
  d->seed = seed;
  long long most = 0, batches = 0;
  for (int i = 0; i < count; ++i) {
    open_file(&d->files[i], paths[i], vocab);
    const long long rows = (d->files[i].count - 1) / seq;
    d->files[i].batches = rows / batch;
    batches += d->files[i].batches;
    if (d->files[i].count > most) most = d->files[i].count;
  }
  if (!batches)
    eg_fail("%s: too few tokens for one batch: the largest file holds %lld, a batch needs "
            "B*T+1 = %lld", paths[0], most, (long long)batch * seq + 1);
  d->rows_epoch = d->rows_shard = -1;
  data_seek(d, 0, 0, 0);
}

// The epoch's file order, drawn when the epoch begins.
static void draw_order(Data* d) {
  long long* order = malloc(sizeof *order * (size_t)d->count);
  if (!order) eg_fail("out of memory");
  const uint64_t words[2] = {d->seed, (uint64_t)d->epoch};
  data_permutation(words, 2, d->count, order);
  for (int i = 0; i < d->count; ++i) d->order[i] = (int)order[i];
  free(order);
}

void data_seek(Data* d, long long epoch, long long shard, long long at) {
  if (epoch < 0 || shard < 0 || at < 0) eg_fail("the data position is negative");
  if (shard >= d->count)
    eg_fail("the data position names file %lld, but %d files are given", shard, d->count);
  d->epoch = epoch;
  d->shard = shard;
  d->at = at;
  draw_order(d);
}

void data_next(Data* d, int* x, int* y) {
  while (d->at >= d->files[d->order[d->shard]].batches) {
    d->at = 0;
    if (d->shard + 1 < d->count) {
      ++d->shard;
    } else {
      ++d->epoch;
      d->shard = 0;
      draw_order(d);
    }
  }
  const TokenFile* t = &d->files[d->order[d->shard]];
  if (d->rows_epoch != d->epoch || d->rows_shard != d->shard) {   // the file's row order
    const long long rows = (t->count - 1) / d->seq;
    free(d->rows);
    d->rows = malloc(sizeof *d->rows * (size_t)rows);
    if (!d->rows) eg_fail("out of memory");
    const uint64_t words[3] = {d->seed, (uint64_t)d->epoch, (uint64_t)d->shard};
    data_permutation(words, 3, rows, d->rows);
    d->rows_epoch = d->epoch;
    d->rows_shard = d->shard;
  }
  for (int b = 0; b < d->batch; ++b) {
    const uint32_t* row = t->tokens + d->rows[d->at * d->batch + b] * d->seq;
    for (int i = 0; i < d->seq; ++i) {
      x[b * d->seq + i] = (int)row[i];
      y[b * d->seq + i] = (int)row[i + 1];
    }
  }
  ++d->at;
}
