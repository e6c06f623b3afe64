// error.h: how the program stops on bad input: one line on stderr, the file first, and a
// non-zero exit status; never a crash.
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

void eg_fail(const char* format, ...) __attribute__((noreturn, format(printf, 1, 2)));

#ifdef __cplusplus
}
#endif
