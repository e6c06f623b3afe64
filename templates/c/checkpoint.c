// checkpoint.c: checkpoint.h (POSIX: mkdir, fsync, rename, flock).
#define _DEFAULT_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint.h"
#include "error.h"
#include "files.h"

enum { STATE_WORDS = 16, PATH = 4096 };
static const char STATE_MAGIC[8] = "EGS1";
static const int64_t STATE_VERSION = 1;

void state_load(const char* path, Training* m, RunState* s) {
  long long size;
  FILE* f = eg_open(path, &size);
  const long long head = STATE_WORDS * 8;
  int64_t w[STATE_WORDS];
  if (size < head) eg_fail("%s: %lld bytes, shorter than its header: truncated", path, size);
  eg_read_at(f, path, w, head, 0);
  if (memcmp(w, STATE_MAGIC, sizeof STATE_MAGIC) != 0)
    eg_fail("%s: not an eulergen training state (its first bytes are not \"EGS1\")", path);
  if (w[1] != STATE_VERSION)
    eg_fail("%s: training state version %lld, this program reads version %lld", path,
            (long long)w[1], (long long)STATE_VERSION);
  if (w[2] != EG_OPTIMIZER)
    eg_fail("%s: an optimizer state of %lld floats, this program was exported for %lld", path,
            (long long)w[2], (long long)EG_OPTIMIZER);
  if (w[9] != EG_SEED)
    eg_fail("%s: a data position of seed %lld, this program was exported for %lld", path,
            (long long)w[9], (long long)EG_SEED);
  if (size != head + 4LL * EG_OPTIMIZER)
    eg_fail("%s: %lld bytes, its optimizer state takes %lld: %s", path, size,
            head + 4LL * EG_OPTIMIZER, size < head + 4LL * EG_OPTIMIZER ? "truncated" : "not "
            "the file this header was written with");
  s->step = w[3];
  s->updates = w[4];
  s->seen = w[5];
  s->epoch = w[6];
  s->shard = w[7];
  s->batch = w[8];
  memcpy(&s->loss_mean, &w[10], sizeof s->loss_mean);
  memcpy(&s->norm_mean, &w[11], sizeof s->norm_mean);
  eg_read_at(f, path, m->optimizer, 4LL * EG_OPTIMIZER, head);
  fclose(f);
}

// -- writing ----------------------------------------------------------------------------

// A path of PATH bytes at most (a longer one is refused, never cut short).
static char* path_of(char* out, const char* format, ...) __attribute__((format(printf, 2, 3)));
static char* path_of(char* out, const char* format, ...) {
  va_list args;
  va_start(args, format);
  const int n = vsnprintf(out, PATH, format, args);
  va_end(args);
  if (n < 0 || n >= PATH) eg_fail("a path of more than %d bytes in the run folder", PATH - 1);
  return out;
}

static char* joined(char* out, const char* dir, const char* name) {
  return path_of(out, "%s/%s", dir, name);
}

static void make_dir(const char* path) {
  char part[PATH];
  path_of(part, "%s", path);
  for (char* p = part + 1; *p; ++p) {   // its parents first, as mkdir -p
    if (*p != '/') continue;
    *p = '\0';
    if (mkdir(part, 0777) != 0 && errno != EEXIST)
      eg_fail("%s: cannot create it (%s)", part, strerror(errno));
    *p = '/';
  }
  if (mkdir(part, 0777) != 0 && errno != EEXIST)
    eg_fail("%s: cannot create it (%s)", part, strerror(errno));
}

static void sync_path(const char* path, const char* step) {
  const int fd = open(path, O_RDONLY);
  if (fd < 0 || fsync(fd) != 0)
    eg_fail("%s: checkpoint of step %s not saved: %s", path, step, strerror(errno));
  close(fd);
}

typedef struct {
  FILE* f;
  const char* path;
  const char* step;
} Out;

static void put(Out* o, const void* data, size_t bytes) {
  if (fwrite(data, 1, bytes, o->f) != bytes)
    eg_fail("%s: checkpoint of step %s not saved: %s", o->path, o->step, strerror(errno));
}

static void text(Out* o, const char* format, ...) __attribute__((format(printf, 2, 3)));
static void text(Out* o, const char* format, ...) {
  va_list args;
  va_start(args, format);
  const int bad = vfprintf(o->f, format, args) < 0;
  va_end(args);
  if (bad) eg_fail("%s: checkpoint of step %s not saved: %s", o->path, o->step, strerror(errno));
}

static Out open_out(const char* path, const char* step) {
  Out o = {fopen(path, "wb"), path, step};
  if (!o.f) eg_fail("%s: checkpoint of step %s not saved: %s", path, step, strerror(errno));
  return o;
}

static void close_out(Out* o) {
  if (fclose(o->f) != 0)
    eg_fail("%s: checkpoint of step %s not saved: %s", o->path, o->step, strerror(errno));
  sync_path(o->path, o->step);
}

static long long elements(const TensorSpec* t) {
  return t->ndim == 1 ? t->shape[0] : (long long)t->shape[0] * t->shape[1];
}

// A safetensors file of `count` tensors, each `specs[i]` at `at[i]` in `arena`: the
// header's length (8 bytes, little-endian, as the host's floats), the JSON header (spaces
// to a multiple of 8), then the tensors' data in that order.
static void safetensors(const char* path, const char* step, const float* arena,
                        const TensorSpec* specs, const long long* at, int count) {
  size_t cap = 4096, used = 0;
  char* head = malloc(cap);
  if (!head) eg_fail("out of memory");
  long long offset = 0;
  for (int i = 0; i < count; ++i) {
    const TensorSpec* t = &specs[i];
    char shape[32], entry[256];
    if (t->ndim == 1) snprintf(shape, sizeof shape, "%d", t->shape[0]);
    else snprintf(shape, sizeof shape, "%d,%d", t->shape[0], t->shape[1]);
    const int n = snprintf(entry, sizeof entry,
                           "%s\"%s\":{\"dtype\":\"F32\",\"shape\":[%s],\"data_offsets\":"
                           "[%lld,%lld]}", i ? "," : "{", t->name, shape, offset,
                           offset + 4 * elements(t));
    offset += 4 * elements(t);
    while (used + (size_t)n + 9 > cap)
      if (!(head = realloc(head, cap *= 2))) eg_fail("out of memory");
    memcpy(head + used, entry, (size_t)n);
    used += (size_t)n;
  }
  if (!count) head[used++] = '{';
  head[used++] = '}';
  while (used % 8) head[used++] = ' ';
  const uint64_t length = used;
  Out o = open_out(path, step);
  put(&o, &length, sizeof length);
  put(&o, head, used);
  for (int i = 0; i < count; ++i)
    put(&o, arena + at[i], sizeof(float) * (size_t)elements(&specs[i]));
  close_out(&o);
  free(head);
}

static void state_json(const char* path, const char* step, const RunState* s) {
  Out o = open_out(path, step);
  text(&o, "{\"adam_updates\": %lld, \"spike_guard\": {\"loss_mean\": %.17g, \"norm_mean\": "
       "%.17g, \"seen\": %lld}, \"data\": {\"epoch\": %lld, \"shard\": %lld, \"batch\": %lld, "
       "\"seed\": %lld, \"world_size\": 1, \"rows\": %d}, \"config\": %s, ", s->updates,
       s->loss_mean, s->norm_mean, s->seen, s->epoch, s->shard, s->batch, (long long)EG_SEED,
       EG_BATCH, EG_RUN_CONFIG);
  if (EG_TOKENIZER_DIGEST[0]) text(&o, "\"tokenizer_digest\": \"%s\", ", EG_TOKENIZER_DIGEST);
  text(&o, "\"step\": %lld, \"format\": 1}\n", s->step);
  close_out(&o);
}

static void remove_checkpoint(const char* dir) {
  static const char* const FILES[] = {"model.safetensors", "optim.safetensors", "state.json"};
  char path[PATH];
  for (int i = 0; i < 3; ++i) unlink(joined(path, dir, FILES[i]));
  rmdir(dir);
}

void run_lock(const char* run_dir) {
  char path[PATH];
  make_dir(run_dir);
  const int fd = open(joined(path, run_dir, ".eulergen-run"), O_RDWR | O_CREAT, 0666);
  if (fd < 0) eg_fail("%s: cannot create it (%s)", path, strerror(errno));
  if (flock(fd, LOCK_EX | LOCK_NB) != 0)
    eg_fail("%s: in use by another trainer: wait for it to finish, or stop it first", run_dir);
  char mark[96];
  const int n = snprintf(mark, sizeof mark, "{\"written_by\": \"eulergen\", \"pid\": %d}\n",
                         (int)getpid());
  if (ftruncate(fd, 0) != 0 || write(fd, mark, (size_t)n) != n)
    eg_fail("%s: cannot write to the run folder (%s)", path, strerror(errno));
  // held until the program exits; the kernel drops it then
  if (access(joined(path, run_dir, "config.json"), F_OK) == 0) return;
  char temp[PATH];
  path_of(temp, "%s/.config.json.%d", run_dir, (int)getpid());
  Out o = open_out(temp, "0");
  text(&o, "%s\n", EG_RUN_CONFIG);
  close_out(&o);
  if (rename(temp, path) != 0) eg_fail("%s: cannot write it (%s)", path, strerror(errno));
}

void checkpoint_save(const char* run_dir, const Training* m, const RunState* s) {
  char step[32], name[64], final[PATH], temp[PATH], old[PATH], path[PATH];
  snprintf(step, sizeof step, "%lld", s->step);
  for (int i = 0; i < EG_TENSOR_COUNT; ++i)   // as eulergen's Trainer.save refuses it
    for (long long e = 0; e < elements(&EG_TENSORS[i]); ++e)
      if (!isfinite(m->params[EG_PARAM_AT[i] + e]))
        eg_fail("%s: %s is not finite after step %s: stopped without saving it", run_dir,
                EG_TENSORS[i].name, step);
  for (int i = 0; i < EG_STATE_COUNT; ++i)
    for (long long e = 0; e < elements(&EG_STATES[i]); ++e)
      if (!isfinite(m->optimizer[EG_STATE_AT[i] + e]))
        eg_fail("%s: %s is not finite after step %s: stopped without saving it", run_dir,
                EG_STATES[i].name, step);
  snprintf(name, sizeof name, "ckpt_%08lld", s->step);
  joined(final, run_dir, name);
  path_of(temp, "%s/.tmp-ckpt_%08lld-%d", run_dir, s->step, (int)getpid());
  path_of(old, "%s/.tmp-ckpt_old-%08lld-%d", run_dir, s->step, (int)getpid());
  if (mkdir(temp, 0777) != 0)
    eg_fail("%s: checkpoint of step %s not saved: %s", temp, step, strerror(errno));
  safetensors(joined(path, temp, "model.safetensors"), step, m->params, EG_TENSORS,
              EG_PARAM_AT, EG_TENSOR_COUNT);
  safetensors(joined(path, temp, "optim.safetensors"), step, m->optimizer, EG_STATES,
              EG_STATE_AT, EG_STATE_COUNT);
  state_json(joined(path, temp, "state.json"), step, s);
  sync_path(temp, step);
  struct stat there;
  const int replacing = stat(final, &there) == 0;   // a step saved again replaces it
  if (replacing && rename(final, old) != 0)
    eg_fail("%s: checkpoint of step %s not saved: %s", final, step, strerror(errno));
  if (rename(temp, final) != 0)
    eg_fail("%s: checkpoint of step %s not saved: %s", final, step, strerror(errno));
  if (replacing) remove_checkpoint(old);
  sync_path(run_dir, step);
}
