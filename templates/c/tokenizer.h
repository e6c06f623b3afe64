// tokenizer.h: the run's tokenizer from tokenizer.bin (README.md, "tokenizer.bin"): the byte
// tokenizer (an id a UTF-8 byte), or a byte-level BPE with GPT-2's pre-tokenizer (the text
// split into words, numbers, punctuation and spaces, then each piece's bytes merged by rank).
#pragma once

typedef struct Tokenizer Tokenizer;

Tokenizer* tokenizer_load(const char* path);
// The ids of UTF-8 `text` into ids[] (room for strlen(text) of them: every token is at
// least a byte); their count. Text that is not UTF-8 is refused, naming `what`.
int tokenizer_encode(const Tokenizer* t, const char* text, const char* what, int* ids);
// The bytes of one id (none for the end of text, other special tokens and ids past the
// tokenizer's, which a model with a larger vocabulary may draw).
const unsigned char* tokenizer_bytes(const Tokenizer* t, int id, int* length);
int tokenizer_vocab(const Tokenizer* t);   // ids 0 … vocab - 1
int tokenizer_eot(const Tokenizer* t);     // the end-of-text id, or -1
