// weights.h: reading weights.bin, the model's parameters in one file (README.md, "weights.bin").
//
// The file: a header of EG_HEADER_INTS little-endian int32 (the format, then the architecture,
// float fields as their float32 bits), a table of EG_TABLE_BYTES a tensor (its name, NUL
// padded, then int32 ndim and two dims), then each tensor's float32 values, row-major, each
// starting at a multiple of EG_ALIGN bytes. The program knows what it was exported for
// (model.c's HEADER and TENSORS); a file that says otherwise is refused in one line.
#pragma once

#include <stdint.h>

#define EG_HEADER_INTS 256
#define EG_TABLE_BYTES 64
#define EG_NAME_BYTES 52
#define EG_ALIGN 64

typedef struct {
  const char* name;   // as the error messages name it
  int32_t value;      // what this program was exported for (a float: its bits)
  int is_float;
} HeaderField;

typedef struct {
  const char* name;   // torch's, as a checkpoint names it
  int ndim;
  int shape[2];
} TensorSpec;

// Reads `path`, checks it against `header` (fields 0, 1, … of the file's header) and
// `tensors`, and points out[i] at tensor i's values, all in one allocation of the floats it
// returns, from out[0].
long long weights_load(const char* path, const HeaderField* header, int fields,
                       const TensorSpec* tensors, int count, float** out);
