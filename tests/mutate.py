"""Mutation testing with mutmut 3: the kill rate of each listed module under the tests that cover it.

    python -m tests.mutate [--modules packing ops/gae ...] [--children 2] [--json build/mutate.json]

Each module runs in its own copy of the checkout (build/mutate/<name>: the committed tree, the built extension and
the kernels link), so mutmut's `mutants/` folder never touches the working tree. mutmut runs, for every mutant,
only the tests that executed the mutated function ("stats" run first). Prints a table of killed / survived /
no tests / timeout per module and writes the survivors' names to the JSON. Not in CI: minutes per module.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the ops' CUDA glue on fake CUDA tensors (FakeTensorMode, launches stubbed): the device paths the CPU tests
# cannot reach (24 tests, under a second)
HOST_SYNC = ["tests/ops/test_host_sync.py"]
FAST = ["-m", "not slow", "-k", "not compile and not deterministic and not same_bits and not on_host"]

# module (path under compactionrl_fast/) -> the tests that exercise it
MODULES = {
    "packing": ["tests/rollout/test_packing.py", "tests/rollout/test_errors.py"],
    # the oracles: their own closed-form tests (tests/ops compare every backend with them, but take minutes per
    # surviving mutant here)
    "reference/gae": ["tests/reference/test_gae_oracle.py"],
    "reference/losses": ["tests/reference/test_loss_oracles.py"],
    # the ops' Python entries under their op's tests, the ones marked slow left out, those that torch.compile the
    # op (dynamo cannot trace mutmut's trampolines) and those that run 2-3 OpenMP threads (a process forked after
    # that hangs in libgomp: each mutant's process is a fork of the one that ran these tests), and the CUDA kernels
    # run on the host (they test csrc/, not the module, slowly)
    "ops/gae": ["tests/ops/test_gae.py", "tests/ops/test_segment_params.py", "tests/ops/test_place.py", *HOST_SYNC,
                *FAST],
    "ops/_reduction": ["tests/ops/test_reduction.py", "tests/ops/test_ppo_loss.py", "tests/ops/test_value_loss.py",
                       *HOST_SYNC, *FAST],
    "ops/denominator": ["tests/ops/test_reduction.py", *FAST],
    "ops/_register": ["tests/ops/test_register.py", "tests/ops/test_reduction.py", "tests/ops/test_ppo_loss.py",
                      "tests/ops/test_value_loss.py", "tests/ops/test_value_head.py", *FAST],
    "ops/ppo_loss": ["tests/ops/test_ppo_loss.py", *HOST_SYNC, *FAST],
    "ops/value_loss": ["tests/ops/test_value_loss.py", *HOST_SYNC, *FAST],
    "ops/value_head": ["tests/ops/test_value_head.py", *HOST_SYNC, *FAST],
    "ops/linear_logprobs": ["tests/ops/test_linear_logprobs.py", *HOST_SYNC, *FAST],
    "ops/_linear_logprobs_loop": ["tests/ops/test_linear_logprobs.py", *HOST_SYNC, *FAST],
    # the checks and the backend choice (with its per-op rules), called directly (fast; the op tests reach them
    # too, slowly); the layout and denominator checks under test_reduction.py
    "ops/_validate": ["tests/ops/test_validate.py", "tests/ops/test_reduction.py", "-m", "not slow"],
    "ops/_dispatch": ["tests/ops/test_validate.py"],
    "integrations/padded": ["tests/integrations/test_packed_layout.py", "tests/integrations/test_padded.py"],
    "integrations/verl/adapter": ["tests/integrations/verl/test_adapter.py"],
    "integrations/openrlhf": ["tests/integrations/test_openrlhf.py", "tests/integrations/test_padded.py"],
    "integrations/trl": ["tests/integrations/test_trl.py", "tests/integrations/test_padded.py"],
    "integrations/_common": ["tests/integrations/test_common.py", "tests/integrations/test_openrlhf.py",
                             "tests/integrations/test_trl.py", "tests/integrations/verl/test_adapter.py"],
    "train/checkpoint": ["tests/train/test_checkpoint.py", "tests/train/test_io.py"],
    # atomic file writes (the root _io before issue 40); test_faults.py kills writers in subprocesses, left out
    "train/atomic": ["tests/train/test_atomic.py", "tests/train/test_io.py", "tests/train/test_checkpoint.py"],
    # without test_faults.py and test_smoke.py: they train in subprocesses (mutants are not visible there)
    # and take a minute
    "train/trainer": ["tests/train/test_trainer.py", "tests/train/test_fit.py", "tests/train/test_checkpoint.py",
                      "tests/train/test_config.py", "tests/train/test_diagnostics.py",
                      "tests/train/test_lr_schedule.py", "tests/train/test_sync.py", "tests/train/test_host_syncs.py"],
    # the step's layout (built once per micro-batch) and its one read of the metrics
    "train/micro_batch": ["tests/train/test_micro_batch.py", "tests/train/test_trainer.py", "tests/train/test_host_syncs.py"],
    "train/readout": ["tests/train/test_readout.py", "tests/train/test_diagnostics.py",
                      "tests/train/test_host_syncs.py", "tests/train/test_trainer.py"],
    # the outer loop (fit) and its log; test_faults.py trains in subprocesses, left out as above
    "train/loop": ["tests/train/test_loop.py", "tests/train/test_fit.py", "tests/train/test_trainer.py",
                   "tests/train/test_sync.py", "tests/train/test_lr_schedule.py", "tests/train/test_checkpoint.py"],
    "train/log": ["tests/train/test_io.py", "tests/train/test_fit.py", "tests/train/test_trainer.py",
                  "tests/train/test_lr_schedule.py"],
    # single-process paths only: the 2-process ones run in tests/test_ddp.py's subprocesses
    "train/dist": ["tests/train/test_trainer.py", "tests/train/test_fit.py"],
    # the config's checks and sources (YAML, flags, --set), and the CLI help built from them
    "train/checks": ["tests/train/test_checks.py", "tests/train/test_config.py", "tests/test_cli.py"],
    "train/config_load": ["tests/train/test_config_load.py", "tests/train/test_config.py", "tests/test_cli.py"],
    # the application (compactionrl_fast/app/, issue 40) under its in-process tests; runs that train in a
    # subprocess (test_smoke.py, test_faults.py, the demo's golden miniature) are left out as above, and so is the
    # CLI run from another folder (mutmut's trampoline there finds no config and fails the unmutated run)
    "app/cli": ["tests/test_cli_commands.py", "tests/test_cli.py", "tests/train/test_config.py", "-k",
                "not from_another_directory"],
    # 10-20 s a mutant here (its test trains tiny ablations in spawned processes): hours for its 529 mutants
    "app/ablations": ["tests/test_ablations.py"],
    # runner's task/build/packer only: run_sft, run_rl and train run in test_smoke.py's subprocesses (496 of its 525
    # mutants have no test here)
    "app/runner": ["tests/train/test_fit.py", "tests/train/test_checkpoint.py", "tests/train/test_lr_schedule.py",
                   "tests/train/test_sync.py", "tests/train/test_server_engine_config.py"],
    # the demo's verdict and files on hand-made results dicts; the tiny demo runs that reach it too (test_cli.py's,
    # test_smoke.py's) train for 5 s and more a mutant, left out
    "app/results": ["tests/test_results.py"],
}


def copy_tree(dst):
    """The committed tree (git archive), the built extension and the kernels link, at `dst`."""
    shutil.rmtree(dst, ignore_errors=True)
    os.makedirs(dst)
    archive = subprocess.run(["git", "archive", "HEAD"], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", dst], input=archive, check=True)
    for so in glob.glob(os.path.join(ROOT, "compactionrl_fast", "_C*.so")):
        shutil.copy(so, os.path.join(dst, "compactionrl_fast"))
    os.symlink("../kernels", os.path.join(dst, "compactionrl_fast", "kernels"))


def run_module(name, tests, children, base):
    dst = os.path.join(base, name.replace("/", "_"))
    copy_tree(dst)
    # mutmut runs the tests in dst/mutants with only these folders (csrc: the loss tests compile the CUDA kernels
    # for the host; docs: the CLI tests compare docs/config.md). A mutant's process is a fork of the one that ran
    # the suite; should one still hang (see FAST), a timeout of 4x the tests' time (mutmut's default: 15x) ends
    # it, counted as not killed
    with open(os.path.join(dst, "pyproject.toml"), "a") as f:
        f.write("\n[tool.mutmut]\n"
                f'source_paths = ["compactionrl_fast/{name}.py"]\n'
                f"pytest_add_cli_args_test_selection = {json.dumps(tests)}\n"
                'also_copy = ["kernels", "tests", "compactionrl_fast", "benchmarks", "csrc", "docs"]\n'
                'timeout_multiplier = 4\n')
    mutmut = [sys.executable, "-m", "mutmut"]
    t0 = time.time()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(os.path.join(dst, "mutmut-run.log"), "w") as log:
        subprocess.run(mutmut + ["run", "--max-children", str(children)], cwd=dst, env=env, stdout=log,
                       stderr=subprocess.STDOUT)
    res = subprocess.run(mutmut + ["results", "--all", "true"], cwd=dst, env=env, capture_output=True, text=True)
    status = {}
    for line in res.stdout.splitlines():
        if ": " in line:
            mutant, st = line.strip().rsplit(": ", 1)
            status[mutant] = st
    counts = {}
    for st in status.values():
        counts[st] = counts.get(st, 0) + 1
    killed, total = counts.get("killed", 0), len(status)
    tested = total - counts.get("no tests", 0) - counts.get("not checked", 0)
    return {"module": name, "tests": tests, "mutants": total, "counts": counts, "seconds": round(time.time() - t0),
            "log": os.path.join(dst, "mutmut-run.log"),
            "kill_rate": killed / tested if tested else None,
            "survived": sorted(m for m, st in status.items() if st == "survived")}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modules", nargs="*", default=list(MODULES), help=f"from: {' '.join(MODULES)}")
    p.add_argument("--children", type=int, default=2, help="parallel mutant runs")
    p.add_argument("--json", default=os.path.join(ROOT, "build", "mutate.json"))
    args = p.parse_args(argv)
    unknown = [m for m in args.modules if m not in MODULES]
    if unknown:
        raise SystemExit(f"unknown module {unknown[0]!r}; choose from {', '.join(MODULES)}")
    base = os.path.join(ROOT, "build", "mutate")
    rows = []
    for name in args.modules:
        row = run_module(name, MODULES[name], args.children, base)
        rows.append(row)
        rate = "-" if row["kill_rate"] is None else f"{row['kill_rate']:.0%}"
        if row["counts"].get("not checked"):  # the unmutated tests failed or the run stopped: nothing to rate
            print(f"{name}: {row['counts']['not checked']} mutants not checked; see {row['log']}", flush=True)
        print(f"{name:24s} mutants {row['mutants']:4d}  killed of tested {rate:>4s}  {row['counts']}  "
              f"{row['seconds']} s", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
