// error.c: eg_fail (error.h).
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "error.h"

void eg_fail(const char* format, ...) {
  va_list args;
  va_start(args, format);
  fputs("error: ", stderr);
  vfprintf(stderr, format, args);
  fputc('\n', stderr);
  va_end(args);
  exit(1);
}
