// backend.h: what model.c asks of the machine besides the ops: memory, copies and the
// linear layers' products. cpu.c (make cpu) and cuda.cu (make cuda) implement it; the ops
// themselves (ops.h) are the generated C functions (<op>.c) or the launches of the generated
// kernels (kernels.cu).
#pragma once

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

const char* eg_backend(void);             // what runs the model, for the start-up line
void* eg_alloc(size_t bytes);             // zeroed memory where the ops run
// The weights where the ops read them, from the host's copy (cpu: that copy itself;
// cuda: a device copy, the host's freed).
const float* eg_weights(float* host, long long floats);
void eg_upload(void* device, const void* host, size_t bytes);
void eg_download(void* host, const void* device, size_t bytes);
void eg_copy(float* dst, const float* src, long long floats);
// y [out] = w [out, in] · x [in], then + b [out] where b is not null: torch's nn.Linear of
// one row.
void eg_linear(const float* x, const float* w, const float* b, float* y, int out, int in);

#ifdef __cplusplus
}
#endif
