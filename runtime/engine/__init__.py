"""The generated library on a backend: numpy or CuPy (backend), the manifest, NVRTC's
compile cache, binding and launching kernels, each op kind's call (cuda_ops, attention,
bias_ops behind ops.OpLibrary), the GEMM libraries, bf16 storage and CUDA graphs.

Imports nothing of eulergen.runtime outside this package."""
