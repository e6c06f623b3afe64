// tokenizer.c: the tokenizer of tokenizer.h, and tokenizer.bin's reader.
//
// tokenizer.bin, little-endian int32 throughout: a header (magic "EGT1", version, kind 0 byte
// or 1 BPE, vocab, end-of-text id or -1, merges, letter ranges, number ranges); a BPE then
// has each id's bytes (a length, then the bytes; 0 for a special token), the id of each
// single byte, its merges (left, right, result) lowest rank first, and the Unicode ranges
// (first, last) of letters (\p{L}) and numbers (\p{N}) its pre-tokenizer tells apart.
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "error.h"
#include "tokenizer.h"

enum { MAGIC = 0x31544745, VERSION = 1, BYTE = 0, BPE = 1 };

typedef struct { int32_t left, right, result; } Merge;

struct Tokenizer {
  int kind, vocab, eot;
  unsigned char** bytes;          // BPE: each id's bytes
  int* lengths;
  int byte_ids[256];              // BPE: the id of each single byte (-1: none)
  Merge* merges;                  // lowest rank first
  int merge_count;
  int32_t* slots;                 // merges by (left, right): index + 1, open addressing
  unsigned slot_mask;
  int32_t (*letters)[2], (*numbers)[2];
  int letter_count, number_count;
};

static void read_ints(FILE* f, const char* path, int32_t* into, long long n) {
  if (fread(into, 4, (size_t)n, f) != (size_t)n)
    eg_fail("%s: truncated (%s)", path, ferror(f) ? strerror(errno) : "the file ends early");
}

static void* grab(size_t bytes, const char* path) {
  void* p = malloc(bytes ? bytes : 1);
  if (!p) eg_fail("%s: out of memory", path);
  return p;
}

static unsigned slot_of(const Tokenizer* t, int32_t left, int32_t right) {
  const uint64_t key = ((uint64_t)(uint32_t)left << 32) | (uint32_t)right;
  return (unsigned)((key * 0x9E3779B97F4A7C15ull) >> 40) & t->slot_mask;
}

static int rank_of(const Tokenizer* t, int32_t left, int32_t right) {
  for (unsigned s = slot_of(t, left, right);; s = (s + 1) & t->slot_mask) {
    const int32_t at = t->slots[s];
    if (at == 0) return INT_MAX;
    const Merge* m = &t->merges[at - 1];
    if (m->left == left && m->right == right) return at - 1;
  }
}

static void read_bpe(Tokenizer* t, FILE* f, const char* path, const int32_t* header) {
  t->bytes = grab(sizeof *t->bytes * (size_t)t->vocab, path);
  t->lengths = grab(sizeof *t->lengths * (size_t)t->vocab, path);
  for (int id = 0; id < t->vocab; ++id) {
    int32_t n;
    read_ints(f, path, &n, 1);
    if (n < 0 || n > 1 << 20) eg_fail("%s: id %d has a length of %d bytes", path, id, n);
    t->lengths[id] = n;
    t->bytes[id] = grab((size_t)n, path);
    if (fread(t->bytes[id], 1, (size_t)n, f) != (size_t)n) eg_fail("%s: truncated", path);
  }
  int32_t ids[256];
  read_ints(f, path, ids, 256);
  for (int b = 0; b < 256; ++b) t->byte_ids[b] = ids[b];
  t->merge_count = header[5];
  t->merges = grab(sizeof *t->merges * (size_t)t->merge_count, path);
  read_ints(f, path, (int32_t*)t->merges, 3LL * t->merge_count);
  unsigned slots = 1;
  while (slots < 2u * (unsigned)t->merge_count + 2) slots <<= 1;
  t->slot_mask = slots - 1;
  t->slots = calloc(slots, sizeof *t->slots);
  if (!t->slots) eg_fail("%s: out of memory", path);
  for (int i = 0; i < t->merge_count; ++i) {
    unsigned s = slot_of(t, t->merges[i].left, t->merges[i].right);
    while (t->slots[s]) s = (s + 1) & t->slot_mask;
    t->slots[s] = i + 1;
  }
  t->letter_count = header[6];
  t->number_count = header[7];
  t->letters = grab(sizeof *t->letters * (size_t)t->letter_count, path);
  t->numbers = grab(sizeof *t->numbers * (size_t)t->number_count, path);
  read_ints(f, path, (int32_t*)t->letters, 2LL * t->letter_count);
  read_ints(f, path, (int32_t*)t->numbers, 2LL * t->number_count);
}

Tokenizer* tokenizer_load(const char* path) {
  FILE* f = fopen(path, "rb");
  if (!f) eg_fail("%s: cannot open it (%s)", path, strerror(errno));
  int32_t header[8];
  read_ints(f, path, header, 8);
  if (header[0] != MAGIC)
    eg_fail("%s: not an eulergen tokenizer (its first bytes are not \"EGT1\")", path);
  if (header[1] != VERSION)
    eg_fail("%s: tokenizer format version %d, this program reads version %d", path, header[1],
            VERSION);
  Tokenizer* t = calloc(1, sizeof *t);
  if (!t) eg_fail("%s: out of memory", path);
  t->kind = header[2];
  t->vocab = header[3];
  t->eot = header[4];
  if (t->kind == BPE) read_bpe(t, f, path, header);
  else if (t->kind != BYTE) eg_fail("%s: unknown tokenizer kind %d", path, t->kind);
  fclose(f);
  return t;
}

int tokenizer_vocab(const Tokenizer* t) { return t->vocab; }
int tokenizer_eot(const Tokenizer* t) { return t->eot; }

const unsigned char* tokenizer_bytes(const Tokenizer* t, int id, int* length) {
  static unsigned char byte;
  if (id == t->eot || id < 0 || id >= t->vocab) {   // a model's ids past the tokenizer's too
    *length = 0;
    return NULL;
  }
  if (t->kind == BYTE) {
    byte = (unsigned char)id;
    *length = 1;
    return &byte;
  }
  *length = t->lengths[id];
  return t->bytes[id];
}

// ---- UTF-8 and the pre-tokenizer's classes ---------------------------------------------

// The code points of `text` into cps[], each one's first byte into at[] (at[n]: the end).
static int decode_utf8(const char* text, const char* what, uint32_t* cps, int* at) {
  const unsigned char* s = (const unsigned char*)text;
  int n = 0, i = 0;
  while (s[i]) {
    const unsigned char c = s[i];
    int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    uint32_t cp = len == 1 ? c : len == 2 ? c & 31u : len == 3 ? c & 15u : c & 7u;
    for (int k = 1; k < len; ++k) {
      if ((s[i + k] & 0xC0) != 0x80) len = 0;
      else cp = (cp << 6) | (s[i + k] & 63u);
    }
    const int overlong = (len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) ||
                         (len == 4 && cp < 0x10000);
    if (!len || overlong || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
      eg_fail("%s: not UTF-8 text (byte 0x%02x at %d)", what, c, i);
    cps[n] = cp;
    at[n++] = i;
    i += len;
  }
  at[n] = i;
  return n;
}

static int in_ranges(uint32_t c, const int32_t (*ranges)[2], int count) {
  int lo = 0, hi = count - 1;
  while (lo <= hi) {
    const int mid = (lo + hi) / 2;
    if (c < (uint32_t)ranges[mid][0]) hi = mid - 1;
    else if (c > (uint32_t)ranges[mid][1]) lo = mid + 1;
    else return 1;
  }
  return 0;
}

// Unicode's White_Space, what \s matches.
static int is_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
         c == 0x205F || c == 0x3000;
}

enum { LETTER, NUMBER, OTHER };

static int is_class(const Tokenizer* t, uint32_t c, int cls) {
  const int letter = in_ranges(c, t->letters, t->letter_count);
  const int number = !letter && in_ranges(c, t->numbers, t->number_count);
  return cls == LETTER ? letter : cls == NUMBER ? number : !letter && !number && !is_space(c);
}

// Where the piece of GPT-2's pattern that starts at cps[p] ends:
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// each alternative tried in turn, as the regex does.
static int piece_end(const Tokenizer* t, const uint32_t* cps, int n, int p) {
  if (cps[p] == '\'' && p + 1 < n) {
    const uint32_t a = cps[p + 1], b = p + 2 < n ? cps[p + 2] : 0;
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return p + 2;
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return p + 3;
  }
  for (int cls = LETTER; cls <= OTHER; ++cls) {
    int q = cps[p] == ' ' && p + 1 < n && is_class(t, cps[p + 1], cls) ? p + 1 : p;
    if (!is_class(t, cps[q], cls)) continue;
    while (q < n && is_class(t, cps[q], cls)) ++q;
    return q;
  }
  int e = p;
  while (e < n && is_space(cps[e])) ++e;
  return e == n || e - p == 1 ? e : e - 1;   // a run before a non-space leaves its last
}

// The BPE ids of one piece's bytes: each byte's id, then the lowest-ranked pair of
// neighbours merged, leftmost first, until no pair has a merge.
static int merge_piece(const Tokenizer* t, const unsigned char* s, int len, int* ids) {
  for (int i = 0; i < len; ++i) {
    ids[i] = t->byte_ids[s[i]];
    if (ids[i] < 0) eg_fail("tokenizer: no token for byte 0x%02x", s[i]);
  }
  int n = len;
  for (;;) {
    int best = INT_MAX, at = -1;
    for (int i = 0; i + 1 < n; ++i) {
      const int r = rank_of(t, ids[i], ids[i + 1]);
      if (r < best) best = r, at = i;
    }
    if (at < 0) return n;
    ids[at] = t->merges[best].result;
    memmove(ids + at + 1, ids + at + 2, sizeof *ids * (size_t)(n - at - 2));
    --n;
  }
}

int tokenizer_encode(const Tokenizer* t, const char* text, const char* what, int* ids) {
  const int bytes = (int)strlen(text);
  uint32_t* cps = grab(sizeof *cps * (size_t)(bytes + 1), what);
  int* at = grab(sizeof *at * (size_t)(bytes + 1), what);
  const int n = decode_utf8(text, what, cps, at);
  int count = 0;
  if (t->kind == BYTE) {
    for (int i = 0; i < bytes; ++i) ids[count++] = (unsigned char)text[i];
  } else {
    for (int p = 0; p < n;) {
      const int e = piece_end(t, cps, n, p);
      count += merge_piece(t, (const unsigned char*)text + at[p], at[e] - at[p], ids + count);
      p = e;
    }
  }
  free(cps);
  free(at);
  return count;
}
