// files.c: files.h.
#include <errno.h>
#include <string.h>
#include <time.h>

#include "error.h"
#include "files.h"

FILE* eg_open(const char* path, long long* size) {
  FILE* f = fopen(path, "rb");
  if (!f) eg_fail("%s: cannot open it (%s)", path, strerror(errno));
  if (fseek(f, 0, SEEK_END) != 0) eg_fail("%s: cannot seek (%s)", path, strerror(errno));
  *size = ftell(f);
  return f;
}

void eg_read_at(FILE* f, const char* path, void* into, long long bytes, long long at) {
  if (fseek(f, at, SEEK_SET) != 0 || fread(into, 1, (size_t)bytes, f) != (size_t)bytes)
    eg_fail("%s: cannot read %lld bytes at %lld (%s)", path, bytes, at,
            ferror(f) ? strerror(errno) : "the file ends first");
}

void eg_beside(char* out, size_t size, const char* argv0, const char* name) {
  const char* slash = strrchr(argv0, '/');
  const int dir = slash ? (int)(slash - argv0) : 1;
  snprintf(out, size, "%.*s/%s", dir, slash ? argv0 : ".", name);
}

double eg_seconds(void) {
  struct timespec t;
  timespec_get(&t, TIME_UTC);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}
