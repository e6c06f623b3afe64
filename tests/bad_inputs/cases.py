"""The bad-input corpus, every surface a user or the machine hands eulergen input through
(tests/test_bad_inputs.py runs it; each module holds one or two surfaces' cases)."""
from __future__ import annotations

from bad_inputs import data, experiments, generate, hf, runs, sources, system

CASES = [*sources.SPECS, *sources.CONFIGS, *data.DATA, *data.PREPARE, *data.TOKENIZERS,
         *runs.CHECKPOINTS, *runs.RUN_FOLDERS, *hf.HF, *hf.EXPORT, *generate.SAMPLING,
         *generate.EVALUATION, *system.DATA_PARALLEL, *system.ENVIRONMENT, *system.SPECIAL,
         *experiments.EXPERIMENTS]
SURFACES = ("op specs", "configs", "data", "tokenizers", "checkpoints", "HF folders", "export",
            "sample and chat", "eval", "data parallel", "environment", "special files",
            "compare and sweep")
