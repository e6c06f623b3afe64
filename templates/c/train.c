// train.c: the training program: it continues the run export-c was given from that
// checkpoint, step after step as eulergen's numpy trainer would (runtime/train/trainer.py,
// step_graph.py, step_control.py): each micro-batch's forward and backward, the gradient
// norm, the step's decision (a loss or norm that is not finite stops the run; one past
// EG_SPIKE_FACTOR x its running mean skips the update; the clip scale), the optimizer's
// step at the learning rate of the run's schedule; then checkpoints eulergen reads.
// Hand-written, as the trainer's loop is: the math of every op is generated (forward.c,
// backward.c, the optimizer's <op>.c).
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint.h"
#include "data.h"
#include "error.h"
#include "files.h"
#include "train_cpu.h"
#include "training.h"

static const char USAGE[] =
    "usage: %s [--steps N] [--run-dir DIR] [--weights FILE] [--state FILE] [TOKEN_FILE...]\n"
    "Continues the run from its checkpoint (weights.bin and train_state.bin beside the\n"
    "program) for N steps (default: to its last, its training.total_steps), on the token\n"
    "files in the loader's order (default: the run's, as export-c found them), and writes\n"
    "checkpoints into DIR (default: run) every training.checkpoint_every steps and at the\n"
    "end, which `eulergen sample DIR` and `eulergen train --resume DIR` read.\n";

// step_record.WHY: what became of a step's update
enum { APPLIED, LOSS_SPIKE, NORM_SPIKE, BAD_LOSS, BAD_NORM };
static const double PI = 3.141592653589793;   // Python's math.pi

typedef struct {
  long long steps;
  const char* run_dir;
  char weights[4096], state[4096];
  const char* const* files;
  int count;
} Options;

static Options parse(int argc, char** argv) {
  Options o = {1LL << 40, "run", "", "", EG_DATA_FILES, EG_DATA_FILE_COUNT};
  eg_beside(o.weights, sizeof o.weights, argv[0], "weights.bin");   // the folder export-c wrote
  eg_beside(o.state, sizeof o.state, argv[0], "train_state.bin");
  int i = 1;
  for (; i < argc && argv[i][0] == '-' && argv[i][1] == '-'; ++i) {
    const char* flag = argv[i];
    if (!strcmp(flag, "--help")) {
      printf(USAGE, argv[0]);
      exit(0);
    }
    if (i + 1 >= argc) eg_fail("%s: needs a value (--help shows the options)", flag);
    const char* v = argv[++i];
    if (!strcmp(flag, "--steps")) {
      char* end;
      errno = 0;
      o.steps = strtoll(v, &end, 10);
      if (errno || *end || end == v || o.steps < 1)
        eg_fail("--steps: '%s' is not a number of steps (1 or more)", v);
    } else if (!strcmp(flag, "--run-dir")) o.run_dir = v;
    else if (!strcmp(flag, "--weights")) snprintf(o.weights, sizeof o.weights, "%s", v);
    else if (!strcmp(flag, "--state")) snprintf(o.state, sizeof o.state, "%s", v);
    else eg_fail("%s: unknown option (--help shows the options)", flag);
  }
  if (i < argc) {
    o.files = (const char* const*)argv + i;
    o.count = argc - i;
  }
  return o;
}

// trainer.learning_rate: linear warmup to EG_LEARNING_RATE, then constant, or linear or
// cosine decay to EG_MIN_LR at EG_TOTAL_STEPS.
static double learning_rate(long long step) {
  if (step <= EG_WARMUP_STEPS) return EG_LEARNING_RATE * (double)step / EG_WARMUP_STEPS;
  if (EG_SCHEDULE == 0) return EG_LEARNING_RATE;
  const long long span = EG_TOTAL_STEPS - EG_WARMUP_STEPS > 1 ? EG_TOTAL_STEPS - EG_WARMUP_STEPS
                                                              : 1;
  const double progress = fmin(1.0, (double)(step - EG_WARMUP_STEPS) / (double)span);
  if (EG_SCHEDULE == 1) return EG_LEARNING_RATE - progress * (EG_LEARNING_RATE - EG_MIN_LR);
  return EG_MIN_LR + 0.5 * (1.0 + cos(PI * progress)) * (EG_LEARNING_RATE - EG_MIN_LR);
}

// step_control.decide, in float64 in its order: what becomes of the step's update, the
// guard's means and count, and the optimizer's control (skip, clip scale, lr, updates).
static int decide(RunState* s, double loss, double norm, double lr, float* control,
                  double* mean) {
  int why = APPLIED;
  *mean = 0.0;
  if (!isfinite(loss)) {
    why = BAD_LOSS;
  } else if (!isfinite(norm)) {
    why = BAD_NORM;
  } else {
    if (EG_SPIKE_FACTOR > 0 && s->seen >= EG_SPIKE_WARMUP) {
      if (loss > EG_SPIKE_FACTOR * s->loss_mean) {
        why = LOSS_SPIKE;
        *mean = s->loss_mean;
      } else if (norm > EG_SPIKE_FACTOR * s->norm_mean) {
        why = NORM_SPIKE;
        *mean = s->norm_mean;
      }
    }
    if (s->seen == 0) {
      s->loss_mean = loss;
      s->norm_mean = norm;
    } else {   // spikes join the means too, damped
      s->loss_mean = EG_SPIKE_DECAY * s->loss_mean + (1 - EG_SPIKE_DECAY) * loss;
      s->norm_mean = EG_SPIKE_DECAY * s->norm_mean + (1 - EG_SPIKE_DECAY) * norm;
    }
    ++s->seen;
  }
  if (why == APPLIED) ++s->updates;
  control[EG_SLOT_SKIP] = why != APPLIED;
  control[EG_SLOT_SCALE] =
      (float)(EG_GRAD_CLIP > 0 && norm > EG_GRAD_CLIP ? EG_GRAD_CLIP / norm : 1.0);
  if (EG_SLOT_LR >= 0) control[EG_SLOT_LR] = (float)lr;
  if (EG_SLOT_STEP >= 0) control[EG_SLOT_STEP] = (float)s->updates;
  return why;
}

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  Training* m = training_new();
  training_load(m, o.weights);
  RunState s;
  state_load(o.state, m, &s);
  if (s.step >= EG_TOTAL_STEPS)
    eg_fail("%s: the run is done: step %lld of its %d (training.total_steps; `eulergen train "
            "--resume` takes --set training.total_steps=N)", o.state, s.step, EG_TOTAL_STEPS);
  Data d;
  data_open(&d, o.files, o.count, EG_BATCH, EG_SEQ, EG_SEED, EG_VOCAB);
  data_seek(&d, s.epoch, s.shard, s.batch);
  run_lock(o.run_dir);
  const long long last = s.step + o.steps < EG_TOTAL_STEPS ? s.step + o.steps : EG_TOTAL_STEPS;
  printf("continuing from step %lld to %lld of %d: %d x %d tokens a step, into %s\n", s.step,
         last, EG_TOTAL_STEPS, EG_MICRO_STEPS * EG_BATCH, EG_SEQ, o.run_dir);
  float control[EG_CONTROL_SLOTS];
  while (s.step < last) {
    const double start = eg_seconds(), lr = learning_rate(s.step + 1);
    double loss = 0.0;
    for (int micro = 0; micro < EG_MICRO_STEPS; ++micro) {
      data_next(&d, training_ids(m), training_targets(m));
      const float batch = forward(m);
      backward(m, micro > 0);
      loss = micro ? loss + batch : batch;
    }
    loss /= EG_MICRO_STEPS;
    const double norm = sqrt(eg_sum_squares(m->grads, EG_PARAMS));
    double mean;
    const int why = decide(&s, loss, norm, lr, control, &mean);
    ++s.step;
    if (why == BAD_LOSS || why == BAD_NORM)
      eg_fail("%s is %g at step %lld; stopped, the last checkpoint is the one before",
              why == BAD_LOSS ? "loss" : "gradient norm", why == BAD_LOSS ? loss : norm, s.step);
    training_step(m, control);
    s.epoch = d.epoch;
    s.shard = d.shard;
    s.batch = d.at;
    printf("step %lld: loss %.9g, lr %.4g, grad norm %.4f, %.0f ms", s.step, loss, lr, norm,
           1e3 * (eg_seconds() - start));
    if (why == LOSS_SPIKE || why == NORM_SPIKE)
      printf(", update skipped: %s %.4f > %g x running mean %.4f",
             why == LOSS_SPIKE ? "loss" : "grad norm", why == LOSS_SPIKE ? loss : norm,
             EG_SPIKE_FACTOR, mean);
    printf("\n");
    fflush(stdout);
    if ((EG_CHECKPOINT_EVERY && s.step % EG_CHECKPOINT_EVERY == 0) || s.step == last)
      checkpoint_save(o.run_dir, m, &s);
  }
  printf("wrote %s/ckpt_%08lld: `eulergen sample %s`\n", o.run_dir, s.step, o.run_dir);
  return 0;
}
