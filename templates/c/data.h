// data.h: the run's token files and the order of its batches, as eulergen's loader
// (runtime/data/loader.py) reads them, so that the program trains on the batches the
// numpy trainer would: the same rows in the same order, every epoch.
//
// A file is an llm.c shard (a header of 256 little-endian int32: magic 20240520 with
// version 1 and uint16 tokens, or 20240801 with version 7 and uint32 tokens, then the
// token count) or a headerless nanoGPT .bin of uint16 tokens. Each is cut into rows of
// T + 1 tokens at stride T; a batch is B rows. Each epoch visits the files in an order
// drawn from (seed, epoch) and the rows of each in an order drawn from (seed, epoch, the
// file's place in that order), with numpy's default_rng (SeedSequence, PCG64) and its
// permutation; the rows left at the end of a file (fewer than B) are skipped.
#pragma once

#include <stdint.h>

typedef struct {
  const char* path;
  uint32_t* tokens;
  long long count, batches;
} TokenFile;

typedef struct {
  TokenFile* files;
  int count, batch, seq;
  uint64_t seed;
  long long epoch, shard, at;   // the next batch: `at` of the shard-th file of the epoch's order
  int* order;                   // the epoch's file order
  long long* rows;              // the rows of the file at `shard`, in their order
  long long rows_epoch, rows_shard;
} Data;

// Opens `count` token files (in the loader's order: sorted by path) for batches of `batch`
// rows of `seq` tokens, every id below `vocab`: one line and exit 1 for a file that is
// missing, truncated, of another format or of another vocabulary, or too short for a batch.
void data_open(Data* d, const char* const* paths, int count, int batch, int seq,
               uint64_t seed, int vocab);
// Moves to a position (a checkpoint's data state), checked against the files.
void data_seek(Data* d, long long epoch, long long shard, long long at);
// The next batch: inputs x [batch, seq] and targets y, y shifted by one token.
void data_next(Data* d, int* x, int* y);
// numpy.random.default_rng(words).permutation(n) into out, for a seed of `count` words.
void data_permutation(const uint64_t* words, int count, long long n, long long* out);
