// weights.c: weights_load (weights.h).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "error.h"
#include "files.h"
#include "weights.h"

static long long align_up(long long n) { return (n + EG_ALIGN - 1) / EG_ALIGN * EG_ALIGN; }

static long long elements(const TensorSpec* t) {
  return t->ndim == 1 ? t->shape[0] : (long long)t->shape[0] * t->shape[1];
}

static float bits_float(int32_t bits) {
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

static void check_header(const char* path, const int32_t* got, const HeaderField* want,
                         int fields) {
  if (got[1] != want[1].value)
    eg_fail("%s: weights format version %d, this program reads version %d", path, got[1],
            want[1].value);
  for (int i = 2; i < fields; ++i) {
    if (got[i] == want[i].value) continue;
    if (want[i].is_float)
      eg_fail("%s: %s %g, this program was exported for %g", path, want[i].name,
              bits_float(got[i]), bits_float(want[i].value));
    eg_fail("%s: %s %d, this program was exported for %d", path, want[i].name, got[i],
            want[i].value);
  }
}

static void check_table(const char* path, const unsigned char* table, const TensorSpec* tensors,
                        int count) {
  for (int i = 0; i < count; ++i) {
    const unsigned char* entry = table + (long long)i * EG_TABLE_BYTES;
    char name[EG_NAME_BYTES + 1] = {0};
    int32_t dims[3];
    memcpy(name, entry, EG_NAME_BYTES);
    memcpy(dims, entry + EG_NAME_BYTES, sizeof dims);
    const TensorSpec* t = &tensors[i];
    if (strcmp(name, t->name) != 0)
      eg_fail("%s: tensor %d is %s, this program wants %s there", path, i, name, t->name);
    if (dims[0] != t->ndim || dims[1] != t->shape[0] || (t->ndim == 2 && dims[2] != t->shape[1]))
      eg_fail("%s: %s has shape [%d, %d] (ndim %d), this program wants [%d, %d] (ndim %d)",
              path, name, dims[1], dims[2], dims[0], t->shape[0], t->ndim == 2 ? t->shape[1] : 0,
              t->ndim);
  }
}

long long weights_load(const char* path, const HeaderField* header, int fields,
                       const TensorSpec* tensors, int count, float** out) {
  long long size;
  FILE* f = eg_open(path, &size);
  const long long table_at = EG_HEADER_INTS * 4;
  const long long data_at = align_up(table_at + (long long)count * EG_TABLE_BYTES);
  int32_t got[EG_HEADER_INTS];
  eg_read_at(f, path, got, size < table_at ? (size < 4 ? size : 4) : table_at, 0);
  if (size < 4 || got[0] != header[0].value)
    eg_fail("%s: not an eulergen weights file (its first bytes are not \"EGW1\")", path);
  if (size < table_at) eg_fail("%s: %lld bytes, shorter than its header: truncated", path, size);
  check_header(path, got, header, fields);
  long long end = data_at;
  for (int i = 0; i < count; ++i) end = align_up(end) + elements(&tensors[i]) * 4;
  if (size != end)
    eg_fail("%s: %lld bytes, its tensors take %lld: %s", path, size, end,
            size < end ? "truncated" : "not the file this header was written with");
  unsigned char* table = malloc((size_t)(count * EG_TABLE_BYTES));
  if (!table) eg_fail("%s: out of memory for its table", path);
  eg_read_at(f, path, table, (long long)count * EG_TABLE_BYTES, table_at);
  check_table(path, table, tensors, count);
  free(table);
  unsigned char* data = malloc((size_t)(end - data_at));
  if (!data) eg_fail("%s: out of memory for %lld bytes of weights", path, end - data_at);
  eg_read_at(f, path, data, end - data_at, data_at);
  fclose(f);
  long long at = data_at;
  for (int i = 0; i < count; ++i) {
    at = align_up(at);
    out[i] = (float*)(data + (at - data_at));
    at += elements(&tensors[i]) * 4;
  }
  return (end - data_at) / 4;
}
