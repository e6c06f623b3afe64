// tests/test_c_tokenizer.py's harness for export-c's tokenizer (templates/c/tokenizer.c):
// `tokenize TOKENIZER.bin TEXT…` prints each TEXT's ids on a line, then their bytes decoded
// back, in hex, on the next.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer.h"

int main(int argc, char** argv) {
  const Tokenizer* t = tokenizer_load(argv[1]);
  for (int a = 2; a < argc; ++a) {
    int* ids = malloc(sizeof *ids * (strlen(argv[a]) + 1));
    const int n = tokenizer_encode(t, argv[a], "text", ids);
    for (int i = 0; i < n; ++i) printf(i ? " %d" : "%d", ids[i]);
    putchar('\n');
    for (int i = 0; i < n; ++i) {
      int length;
      const unsigned char* bytes = tokenizer_bytes(t, ids[i], &length);
      for (int k = 0; k < length; ++k) printf("%02x", bytes[k]);
    }
    putchar('\n');
    free(ids);
  }
  return 0;
}
