"""Hugging Face transformers folders: reading one (safetensors, config.json, its
tokenizer) into eulergen's parameters, and exporting a model as one.

Imports model and data."""
