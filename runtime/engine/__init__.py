"""The generated library on a backend: numpy or CuPy (backend), the manifest, NVRTC's
compile cache, binding and launching kernels, each op kind's calls (kinds/, through
registry, behind ops.OpLibrary; cuda_ops their device state, attention the flash launches),
the GEMM libraries, bf16 storage and CUDA graphs.

Imports nothing of eulergen.runtime outside this package."""
