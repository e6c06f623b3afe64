"""What the machine hands eulergen: data-parallel ranks and their launchers' variables,
eulergen's own environment variables, and special files and symlinks where any file is
read or written."""
from __future__ import annotations

import socket

from bad_inputs.case import (FIFO, LONG, ON_SHARD, PLAN_OPS, QUICK, SAMPLE, TRAIN, Case, link,
                             sparse, surface)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


PORT = str(_free_port())   # nobody listens there: a rank 0 that never comes
QUICK_RUN = (*TRAIN, *ON_SHARD)


def ranks(rank: int, world: int = 2, **more) -> dict:
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
            "MASTER_PORT": PORT, "EULERGEN_COLLECTIVE_TIMEOUT": "0.5", **more}


DATA_PARALLEL = surface("data parallel", [
    Case("nproc-a-thousand-on-numpy", ("train", "--nproc", "1000", *QUICK, *ON_SHARD),
         "1,000 ranks on numpy, one a core", uses=("shard",), where="--nproc", fault="hang"),
    Case("nproc-too-long", ("train", "--nproc", LONG), "is not a valid integer", where="--nproc",
         fault="traceback"),
    Case("nproc-past-any-machine", ("plan", "--nproc", str(1 << 20)), "--nproc",
         where="1<=x<=65536", fault="hang"),
    Case("nproc-under-a-launcher", ("train", "--nproc", "2", *QUICK, *ON_SHARD),
         "leave --nproc out", uses=("shard",), env=ranks(0), where="--nproc"),
    Case("rank-1-never-comes", QUICK_RUN, "rank 1 did not arrive at the rendezvous within 0.5s",
         uses=("shard",), env=ranks(0), where="collective", fault="hang", seconds=6),
    Case("rank-0-never-opens", QUICK_RUN, f"rank 0 did not open 127.0.0.1:{PORT} within 0.5s",
         uses=("shard",), env=ranks(1), where="MASTER_ADDR", fault="hang", seconds=6),
    Case("rank-outside-the-world", QUICK_RUN, "RANK: 2 is outside 0..1", uses=("shard",),
         env=ranks(2)),
    Case("rank-not-a-number", QUICK_RUN, "RANK: 'zero': want an integer", uses=("shard",),
         env=ranks(0, RANK="zero"), fault="traceback"),
    Case("world-size-too-long", QUICK_RUN, "WORLD_SIZE: '99999999999999999999'… (5,000 characters)",
         uses=("shard",), env=ranks(0, WORLD_SIZE=LONG), fault="traceback"),
    Case("world-size-a-million", QUICK_RUN, "WORLD_SIZE: '2000000': want an integer in 0..1,048,576",
         uses=("shard",), env=ranks(0, WORLD_SIZE="2000000"), fault="hang"),
    Case("local-rank-negative", QUICK_RUN, "LOCAL_RANK: '-1'", uses=("shard",),
         env=ranks(0, LOCAL_RANK="-1"), fault="traceback"),
    Case("master-port-unset", QUICK_RUN, "MASTER_PORT is not set", uses=("shard",),
         env={"RANK": "0", "WORLD_SIZE": "2"}),
    Case("master-port-past-65535", QUICK_RUN, "MASTER_PORT: '70000': want an integer in 1..65,535",
         uses=("shard",), env=ranks(0, MASTER_PORT="70000"), fault="traceback"),
    Case("master-port-zero", QUICK_RUN, "MASTER_PORT: '0'", uses=("shard",),
         env=ranks(0, MASTER_PORT="0"), fault="traceback"),
    Case("master-addr-with-a-space", QUICK_RUN, "MASTER_ADDR: 'local host': want a host name",
         uses=("shard",), env=ranks(0, MASTER_ADDR="local host"), fault="traceback"),
    Case("slurm-tasks-not-a-number", QUICK_RUN, "SLURM_NTASKS: 'two'", uses=("shard",),
         env={"SLURM_NTASKS": "two", "SLURM_PROCID": "0", "MASTER_PORT": PORT},
         fault="traceback"),
])

ENVIRONMENT = surface("environment", [
    *(Case(f"collective-timeout-{name}", ("plan",), f"EULERGEN_COLLECTIVE_TIMEOUT: {shown}",
           env={"EULERGEN_COLLECTIVE_TIMEOUT": value}, where="want seconds in (0, 604,800]"
           if name != "a-word" else "not a number of seconds", fault=fault)
      for name, value, shown, fault in (
          ("negative", "-5", "'-5'", "traceback"), ("zero", "0", "'0'", "hang"),
          ("nan", "nan", "'nan'", "traceback"), ("inf", "inf", "'inf'", "hang"),
          ("a-year", "31536000", "'31536000'", "hang"), ("a-word", "soon", "'soon'", "wrong"))),
    Case("collective-timeout-too-long", ("plan",), "EULERGEN_COLLECTIVE_TIMEOUT: '99999999",
         env={"EULERGEN_COLLECTIVE_TIMEOUT": LONG}, where="(5,000 characters)", fault="hang"),
    Case("gemm-library-unknown", ("plan",), "EULERGEN_GEMM: 'cublass': want one of auto, lt, "
         "cublas (did you mean 'cublas'?)", env={"EULERGEN_GEMM": "cublass"}, fault="silent"),
    Case("launcher-pid-not-a-number", ("plan",), "EULERGEN_LAUNCHER_PID: 'me'",
         env={"EULERGEN_LAUNCHER_PID": "me"}, fault="traceback"),
    Case("a-misspelt-variable", ("plan",), "EULERGEN_COLECTIVE_TIMEOUT is not a variable eulergen "
         "reads (did you mean 'EULERGEN_COLLECTIVE_TIMEOUT'?)",
         env={"EULERGEN_COLECTIVE_TIMEOUT": "5"}, where="warning:", code=0, fault="silent"),
    Case("an-unknown-variable", ("plan",), "EULERGEN_FOO is not a variable eulergen reads (valid "
         "variables: EULERGEN_CACHE", env={"EULERGEN_FOO": "1"}, where="warning:", code=0,
         fault="silent"),
    Case("ops-path-missing", ("check", "gelu"), "ops directory does not exist",
         env={"EULERGEN_OPS_PATH": "gone"}, where="gone"),
    Case("ops-path-a-file", (*QUICK_RUN, "--set", "model.activation=myact"),
         "not a folder of op specs", {"notes.txt": "x"}, uses=("shard",),
         env={"EULERGEN_OPS_PATH": "notes.txt"}),
    Case("cache-a-file", ("eval", "run", "--device", "numpy", "--data", "builtin:stdlib"),
         "Not a directory", {"notes.txt": "x"}, uses=("run",),
         env={"EULERGEN_CACHE": "notes.txt"}, where="notes.txt/data"),
])

SPECIAL = surface("special files", [
    Case("spec-a-fifo", PLAN_OPS, "a FIFO, not a regular file: a spec file is read only from a file",
         {"ops/myact.yaml": FIFO}, fault="hang"),
    Case("spec-a-link-to-dev-zero", PLAN_OPS, "a symlink to /dev/zero, a character device",
         {"ops/myact.yaml": link("/dev/zero")}, fault="hang"),
    Case("spec-a-dangling-link", PLAN_OPS, "spec file not found (a symlink to nowhere.yaml, "
         "which does not exist)", {"ops/myact.yaml": link("nowhere.yaml")}, fault="traceback"),
    Case("spec-a-folder", PLAN_OPS, "a folder, not a regular file", {"ops/myact.yaml/x": "y"},
         where="ops/myact.yaml", fault="traceback"),
    Case("spec-on-the-ops-path-a-fifo", (*QUICK_RUN, "--set", "model.activation=myact"),
         "a FIFO, not a regular file", {"mine/myact.yaml": FIFO}, uses=("shard",),
         env={"EULERGEN_OPS_PATH": "mine"}, fault="hang"),
    Case("config-a-fifo", ("plan", "--config", "c.yaml"), "a FIFO", {"c.yaml": FIFO},
         fault="hang"),
    Case("config-a-link-to-dev-zero", ("plan", "--config", "c.yaml"),
         "a symlink to /dev/zero, a character device", {"c.yaml": link("/dev/zero")},
         fault="hang"),
    Case("config-a-folder", ("plan", "--config", "conf"), "a folder, not a regular file",
         {"conf/x": "y"}, where="conf"),
    Case("shard-a-fifo", (*TRAIN, "--set", "data.dataset=d.bin"), "a FIFO, not a regular file: "
         "a token file", {"d.bin": FIFO}, fault="hang"),
    Case("shard-a-link-to-dev-zero", (*TRAIN, "--set", "data.dataset=d.bin"),
         "a symlink to /dev/zero", {"d.bin": link("/dev/zero")}, fault="hang"),
    Case("shard-a-dangling-link", (*TRAIN, "--set", "data.dataset=d.bin"),
         "token file not found (a symlink to gone.bin", {"d.bin": link("gone.bin")}),
    Case("shard-a-folder", (*TRAIN, "--set", "data.dataset=data"), "a folder, not a regular file",
         uses=("shard",), where="data"),
    Case("eval-data-a-fifo", ("eval", "run", "--device", "numpy", "--data", "d.bin"), "a FIFO",
         {"d.bin": FIFO}, uses=("run",), fault="hang"),
    Case("tokenizer-a-fifo", (*QUICK_RUN, "--set", "data.tokenizer=tok.json"), "a FIFO",
         {"tok.json": FIFO}, uses=("shard",), fault="hang"),
    Case("tokenizer-too-large", (*QUICK_RUN, "--set", "data.tokenizer=tok.json"),
         "a tokenizer file is at most 268,435,456", {"tok.json": sparse((256 << 20) + 1)},
         uses=("shard",), fault="hang"),
    Case("resume-config-a-fifo", ("train", "--resume", "run"), "a FIFO",
         {"run/config.json": FIFO}, uses=("run",), fault="hang"),
    Case("state-json-a-fifo", SAMPLE, "a FIFO", {"run/ckpt_00000002/state.json": FIFO},
         uses=("run",), fault="hang"),
    Case("weights-a-link-to-dev-zero", SAMPLE, "a symlink to /dev/zero",
         {"run/ckpt_00000002/model.safetensors": link("/dev/zero")}, uses=("run",),
         fault="hang"),
    Case("hf-config-a-fifo", ("sample", "hf", "--device", "numpy"), "a FIFO",
         {"hf/config.json": FIFO}, uses=("hf",), fault="hang"),
    Case("hf-weights-a-fifo", ("sample", "hf", "--device", "numpy"), "a FIFO",
         {"hf/model.safetensors": FIFO}, uses=("hf",), fault="hang"),
    Case("hf-tokenizer-a-link-to-dev-zero", ("sample", "hf", "--device", "numpy"),
         "a symlink to /dev/zero", {"hf/tokenizer.json": link("/dev/zero")}, uses=("hf",),
         fault="hang"),
    Case("prepare-source-a-fifo", ("prepare", "a.txt", "--out", "out", "--tokenizer", "byte",
                                   "--quiet"), "a FIFO, not a regular file: a source file",
         {"a.txt": FIFO}, fault="hang"),
    Case("prepare-source-a-link-to-dev-zero", ("prepare", "a.jsonl", "--out", "out",
                                               "--tokenizer", "byte", "--quiet"),
         "a symlink to /dev/zero", {"a.jsonl": link("/dev/zero")}, fault="hang"),
    Case("prepare-manifest-a-fifo", ("prepare", "a.txt", "--out", "out", "--tokenizer", "byte",
                                     "--quiet"), "a FIFO", {"a.txt": "x", "out/prepare.json": FIFO},
         where="out/prepare.json", fault="hang"),
    Case("prepare-out-a-dangling-link", ("prepare", "a.txt", "--out", "out", "--tokenizer",
                                         "byte", "--quiet"),
         "a symlink to elsewhere, which does not exist", {"a.txt": "x", "out": link("elsewhere")},
         where="out", fault="traceback"),
    Case("prepare-out-a-link-to-the-users-folder", ("prepare", "a.txt", "--out", "out",
                                                    "--tokenizer", "byte", "--quiet"),
         "holds files prepare did not write (notes.md)",
         {"a.txt": "x", "mine/notes.md": "mine", "out": link("mine")}, where="out",
         fault="data loss"),
    Case("plot-metrics-a-fifo", ("plot", "p"), "a FIFO", {"p/metrics.jsonl": FIFO}, fault="hang"),
    Case("plot-png-a-link", ("plot", "p"), "a file is there already",
         {"p/metrics.jsonl": '{"step": 1, "train_loss": 1.0}\n', "mine.png": "mine",
          "p/loss.png": link("../mine.png")}, where="p/loss.png", fault="data loss"),
    Case("run-dir-a-dangling-link", ("train", "--run-dir", "out", *QUICK, *ON_SHARD),
         "a symlink to gone, which does not exist", {"out": link("gone")}, uses=("shard",),
         where="out", fault="traceback"),
    Case("run-dir-a-link-to-the-users-folder", ("train", "--run-dir", "out", *QUICK, *ON_SHARD),
         "holds files eulergen did not write (notes.md)",
         {"mine/notes.md": "mine", "out": link("mine")}, uses=("shard",), where="out",
         fault="data loss"),
    Case("run-marker-a-fifo", ("train", "--run-dir", "r", *QUICK, *ON_SHARD),
         "holds files eulergen did not write (.eulergen-run)", {"r/.eulergen-run": FIFO},
         uses=("shard",), where="r", fault="hang"),
    Case("export-out-a-link", ("export", "run", "--out", "out"), "a symlink (to mine)",
         {"mine/x": "y", "out": link("mine")}, uses=("run",), where="--out", fault="data loss"),
    Case("export-marker-a-fifo", ("export", "run", "--out", "out"),
         "holds files export did not write (.eulergen-export)", {"out/.eulergen-export": FIFO},
         uses=("run",), where="out", fault="hang"),
    Case("tokenizer-train-out-a-link", ("tokenizer", "train", "a.txt", "--vocab-size", "300",
                                        "--out", "t.json"), "a file is there already",
         {"a.txt": "abc\n", "t.json": link("a.txt")}, where="t.json", fault="data loss"),
    Case("tokenizer-train-out-a-dangling-link", ("tokenizer", "train", "a.txt", "--vocab-size",
                                                 "300", "--out", "t.json"),
         "a file is there already", {"a.txt": "abc\n", "t.json": link("elsewhere.json")},
         where="t.json", fault="data loss"),
    Case("tokenizer-train-source-a-fifo", ("tokenizer", "train", "a.txt", "--vocab-size", "300",
                                           "--out", "t.json"), "a FIFO", {"a.txt": FIFO},
         fault="hang"),
    Case("user-op-a-link-to-dev-zero", (*QUICK_RUN, "--ops", "ops", "--set",
                                        "model.activation=myact"),
         "a symlink to /dev/zero", {"ops/myact.yaml": link("/dev/zero")}, uses=("shard",),
         fault="hang"),
])
