// main.c: the program: read the options, load the weights and the tokenizer, prefill the
// prompt, then draw each new token and feed it back (a step of one position over the KV
// cache), as `eulergen sample` does: the same draws for a seed, the same end at the end of
// text, and the same crop when the cache is full (the last EG_CONTEXT / 2 tokens prefilled
// again).
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "error.h"
#include "files.h"
#include "model.h"
#include "sample.h"
#include "tokenizer.h"

static const char USAGE[] =
    "usage: %s [--prompt TEXT] [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P]\n"
    "          [--seed S] [--ids] [--weights FILE] [--tokenizer FILE]\n"
    "Continues TEXT (default a newline) with up to N new tokens (default 200), drawn at\n"
    "temperature T (0.8; 0: greedy) from the K most likely (40; 0: all) within nucleus P\n"
    "(1: all) with seed S (0). --ids prints the new ids instead of the text.\n";

typedef struct {
  const char* prompt;
  int max_new_tokens, ids;
  Settings settings;
  char weights[4096], tokenizer[4096];
} Options;

static long long integer(const char* flag, const char* text, long long lo, long long hi) {
  char* end;
  errno = 0;
  const long long v = strtoll(text, &end, 10);
  if (errno || *end || end == text || v < lo || v > hi)
    eg_fail("%s: '%s' is not an integer from %lld to %lld", flag, text, lo, hi);
  return v;
}

static float number(const char* flag, const char* text, double lo, double hi, int open_lo) {
  char* end;
  errno = 0;
  const double v = strtod(text, &end);
  if (errno || *end || end == text || !(open_lo ? v > lo : v >= lo) || !(v <= hi))
    eg_fail("%s: '%s' is not a number in %s%g, %g]", flag, text, open_lo ? "(" : "[", lo, hi);
  return (float)v;
}

static Options parse(int argc, char** argv) {
  Options o = {"\n", 200, 0, {0.8f, 40, 1.0f, 0}, "", ""};
  // beside the program unless given: the folder export-c wrote holds everything
  eg_beside(o.weights, sizeof o.weights, argv[0], "weights.bin");
  eg_beside(o.tokenizer, sizeof o.tokenizer, argv[0], "tokenizer.bin");
  for (int i = 1; i < argc; ++i) {
    const char* flag = argv[i];
    if (!strcmp(flag, "--help") || !strcmp(flag, "-h")) {
      printf(USAGE, argv[0]);
      exit(0);
    }
    if (!strcmp(flag, "--ids")) {
      o.ids = 1;
      continue;
    }
    if (i + 1 >= argc) eg_fail("%s: needs a value (--help shows the options)", flag);
    const char* v = argv[++i];
    if (!strcmp(flag, "--prompt")) o.prompt = v;
    else if (!strcmp(flag, "--max-new-tokens"))
      o.max_new_tokens = (int)integer(flag, v, 1, 1 << 30);
    else if (!strcmp(flag, "--temperature")) o.settings.temperature = number(flag, v, 0, 1e30, 0);
    else if (!strcmp(flag, "--top-k")) o.settings.top_k = (int)integer(flag, v, 0, 1 << 30);
    else if (!strcmp(flag, "--top-p")) o.settings.top_p = number(flag, v, 0, 1, 1);
    else if (!strcmp(flag, "--seed")) o.settings.seed = (uint64_t)integer(flag, v, 0, INT64_MAX);
    else if (!strcmp(flag, "--weights")) snprintf(o.weights, sizeof o.weights, "%s", v);
    else if (!strcmp(flag, "--tokenizer")) snprintf(o.tokenizer, sizeof o.tokenizer, "%s", v);
    else eg_fail("%s: unknown option (--help shows the options)", flag);
  }
  return o;
}

// The KV cache's tokens: positions 0 … length - 1 hold held[0 … length - 1].
typedef struct {
  Model* model;
  int held[EG_CONTEXT + 1];
  int length;
} Context;

static const float* prefill(Context* c, const int* ids, int n) {
  const float* logits = NULL;
  memmove(c->held, ids, sizeof *ids * (size_t)n);
  for (int pos = 0; pos < n; ++pos) logits = model_step(c->model, c->held[pos], pos);
  c->length = n;
  return logits;
}

// One more position for `id`; when the cache is full, the last EG_CONTEXT / 2 tokens it
// holds (`id` the last of them) are prefilled again.
static const float* feed(Context* c, int id) {
  if (c->length + 1 > EG_CONTEXT) {
    c->held[c->length] = id;
    const int keep = EG_CONTEXT / 2;
    return prefill(c, c->held + c->length + 1 - keep, keep);
  }
  c->held[c->length] = id;
  return model_step(c->model, id, c->length++);
}

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  Tokenizer* tok = tokenizer_load(o.tokenizer);
  if (tokenizer_vocab(tok) > EG_VOCAB)
    eg_fail("%s: %d ids, more than the model's %d", o.tokenizer, tokenizer_vocab(tok), EG_VOCAB);
  int* prompt = malloc(sizeof *prompt * (strlen(o.prompt) + 1));
  if (!prompt) eg_fail("out of memory");
  const int n = tokenizer_encode(tok, o.prompt, "--prompt", prompt);
  if (n == 0) eg_fail("--prompt: empty: sampling needs at least one token");
  if (n > EG_CONTEXT)
    eg_fail("--prompt: %d tokens, more than the model's context of %d", n, EG_CONTEXT);
  Context c = {model_load(o.weights), {0}, 0};
  Sampler* sampler = sampler_new(EG_VOCAB);
  if (!o.ids) fputs(o.prompt, stdout);
  const double start = eg_seconds();
  const float* logits = prefill(&c, prompt, n);
  int made = 0;
  for (int step = 0; step < o.max_new_tokens; ++step) {
    const double u = sampler_uniform(o.settings.seed, step, 0);
    const int id = sampler_pick(sampler, logits, u, &o.settings);
    if (id == tokenizer_eot(tok)) break;
    ++made;
    if (o.ids) {
      printf(step ? " %d" : "%d", id);
    } else {
      int length;
      const unsigned char* bytes = tokenizer_bytes(tok, id, &length);
      fwrite(bytes, 1, (size_t)length, stdout);
    }
    fflush(stdout);
    if (step + 1 < o.max_new_tokens) logits = feed(&c, id);
  }
  putchar('\n');
  const double took = eg_seconds() - start;
  fprintf(stderr, "%s: %d prompt tokens and %d new in %.3f s (%.1f tokens/s)\n", eg_backend(), n,
          made, took, (n + made) / (took > 0 ? took : 1e-9));
  return 0;
}
