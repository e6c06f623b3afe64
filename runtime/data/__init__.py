"""Tokens: llm.c shards and the loaders over them (loader), tokenizers (byte, GPT-2, HF
files, BPE training), and `eulergen prepare` (sources, prepare; prepared: the manifest it leaves).

Imports nothing of eulergen.runtime outside this package."""
