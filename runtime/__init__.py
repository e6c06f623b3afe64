"""The eulergen runtime: numpy on the CPU, CuPy on a GPU.

It loads what `generated/` holds through the manifest and never imports the generator
(DESIGN.md, "Who may import whom"). Its sub-packages, from the bottom up; a package imports
only those before it (tests/test_imports.py holds them to LAYERS):

- engine: the generated library on a backend (manifest, NVRTC cache, launches, GEMMs, CUDA graphs)
- model: the model graph, its parameters, memory plan and tapes
- data: token shards, loaders, tokenizers, `prepare`
- interop: Hugging Face folders in and out
- distributed: collectives, gradient buckets, data parallel, rank launching
- generate: the KV-cache decoder, the draw, sampling
- train: the run's config, the step, the optimizer, checkpoints, run folders, metrics, eval
"""

LAYERS = ("engine", "model", "data", "interop", "distributed", "generate", "train")
