"""Training: the run's config and its resolution into arch and plan (resolve), its size
budget, the step (step control, the graphed Stepper), the optimizer, checkpoints, run
folders, metrics, the Trainer, and evaluation.

The top of the runtime: imports any package before it in LAYERS."""
