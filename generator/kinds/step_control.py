"""A training step's scalars on the device: the micro-steps' loss sum, a rank's loss, the
step's decision and the batch's loss mean (templates/step_control.cu.j2, hand-written). No
formula, so no spec: one op, named after its kind, rendered from its template alone, with no
numpy module (runtime/train/step_control.py holds the numpy forms). The record's slots and
the why-codes reach the template from eulergen/step_record.py, which the runtime reads the
record by."""
from __future__ import annotations

from eulergen import step_record
from eulergen.generator.kinds.support import Support
from eulergen.generator.plan import LOSS_MEAN_LAUNCH, STEP_LAUNCH
from eulergen.signature import KernelSig

# Each kernel's parameters, by its call (the signature's stage). The record is float64, the
# losses, norms and the update op's control slots float32.
ARGS = {
    "accumulate": (("rec", "double*"), ("loss", "const float*"), ("first", "int")),
    "rank_loss": (("rec", "const double*"), ("out", "float*"), ("micro", "int")),
    "decide": (("rec", "double*"), ("control", "float*"), ("norm_in", "const float*"),
               ("reduced", "const float*"), ("factor", "double"), ("decay", "double"),
               ("warmup", "double"), ("clip", "double"), ("micro", "int"), ("ranks", "int"),
               ("zero", "int"), ("skip_at", "int"), ("scale_at", "int"), ("lr_at", "int"),
               ("step_at", "int")),
    "loss_mean": (("losses", "const float*"), ("out", "float*"), ("n", "long long")),
}


class StepControl(Support):
    name = "step_control"
    template = templates = "step_control.cu.j2"

    def sigs(self):
        return tuple(KernelSig(f"step_control_{call}", args, "f32", call,
                               LOSS_MEAN_LAUNCH if call == "loss_mean" else STEP_LAUNCH)
                     for call, args in ARGS.items())

    def context(self):
        return {"record": step_record.AT, "why": step_record.WHY}


KIND = StepControl()
