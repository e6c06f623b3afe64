// files.h: what the programs' readers and loops share: a file opened with its size, bytes
// read at an offset, a file beside the program, the wall clock. Each failure is one line
// (error.h) naming the file.
#pragma once

#include <stddef.h>
#include <stdio.h>

FILE* eg_open(const char* path, long long* size);
void eg_read_at(FILE* f, const char* path, void* into, long long bytes, long long at);
// `name` in the folder of the program argv0 names, into out
void eg_beside(char* out, size_t size, const char* argv0, const char* name);
double eg_seconds(void);
