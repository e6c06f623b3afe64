"""Data parallel: the collectives (CPU hub, NCCL), the gradient buckets and ZeRO-1's
shares, the step's reductions, and starting the ranks of `train --nproc`.

Imports engine and model."""
