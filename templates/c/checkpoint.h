// checkpoint.h: what the training program reads besides the weights, and the checkpoints it
// writes, in eulergen's format (runtime/train/checkpoint.py), so that `eulergen sample`,
// `eulergen export-c` and `eulergen train --resume` read them.
//
// train_state.bin (README.md, "train_state.bin"): the exported checkpoint's step, the
// optimizer's update count, the spike guard's state, the data position and the optimizer
// arena. A run folder: config.json (the run's config), and ckpt_<step, 8 digits>/ holding
// model.safetensors (the weights by torch's names), optim.safetensors (the optimizer's
// state: <state>.<name>, adamw's m. and v.) and state.json; each written into a hidden
// folder beside it, every file synced, then renamed into place. The folder is locked while the program
// trains (the flock eulergen's trainer takes on its .eulergen-run).
#pragma once

#include "training.h"

typedef struct {
  long long step;                  // the last step done
  long long updates;               // updates applied (adamw's bias correction counts them)
  long long seen;                  // the steps the spike guard has taken into its means
  double loss_mean, norm_mean;     // its running means
  long long epoch, shard, batch;   // the data position of the next batch (data.h)
} RunState;

// Reads train_state.bin into `s` and the optimizer arena of `m`; one line and exit 1 for a file
// that is missing, truncated or another run's.
void state_load(const char* path, Training* m, RunState* s);
// Locks `run_dir` (created, with config.json where it has none) for this process.
void run_lock(const char* run_dir);
// Writes ckpt_<s->step> of the weights and optimizer state of `m` and the state `s` into
// `run_dir`; refused, in one line, where one of them is not finite.
void checkpoint_save(const char* run_dir, const Training* m, const RunState* s);
