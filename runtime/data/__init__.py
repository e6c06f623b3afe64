"""Tokens: llm.c shards and the loaders over them (loader), tokenizers (byte, GPT-2, HF
files, BPE training), and `eulergen prepare` (sources, prepare).

Imports nothing of eulergen.runtime outside this package."""
