// train_cpu.h: what the training program computes besides the ops (forward.c and
// backward.c call these between the ops' functions), on the CPU: the linear layers'
// products as eulergen's numpy trainer calls them (runtime/engine/gemm.py) and the adds,
// fills and sums of its tape and its loss (runtime/model/tape.py, gpt.py).
#pragma once

// c [m, n] = op(a) [m, k] · op(b) [k, n], or with `add` c + it; op(a) is a [k, m]
// transposed where `ta`, op(b) b [n, k] transposed where `tb`. Each element is summed in
// double and rounded once (and, added, rounded again, as numpy's c += a @ b).
void eg_matmul(const float* a, const float* b, float* c, int m, int n, int k, int ta, int tb,
               int add);
void eg_add(float* y, const float* x, long long n);                      // y += x
void eg_add_rows(float* y, const float* b, long long rows, int cols);    // y[r] += b
// x[r][from …] = value: the padded vocab rows' logits
void eg_fill_columns(float* x, long long rows, int cols, int from, float value);
float eg_mean(const float* x, long long n);                              // summed in double
double eg_sum_squares(const float* x, long long n);                      // likewise
