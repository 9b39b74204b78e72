"""slime's real argument parsing in a process of its own (it needs the job's import stand-ins, _stubs.install_job,
which the test process must not take on: they register an accelerator backend and stub modules for good):

    python -m tests.integrations.slime._slime_args OUT.pkl <train.py's flags>

runs slime's `parse_args()` (its own flags and validation, Megatron-LM's parser stood in as in the job) on the
flags, then builds slime's `GenerateState(args)`, and pickles `(args, sampling_params)`: the arguments object
and the sampling parameters slime's rollout passes to a --custom-generate-function-path function.
`parse(flags, out)` runs it and returns the pair."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def parse(flags, out):
    """(args, sampling_params) of slime for train.py's `flags`; `out`: a path for the pickle."""
    import slime

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.dirname(os.path.dirname(slime.__file__))]))
    run = subprocess.run([sys.executable, "-m", "tests.integrations.slime._slime_args", str(out), *flags], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    with open(out, "rb") as f:
        return pickle.load(f)


def main(out, argv):
    from . import _stubs

    _stubs.install_job()
    sys.argv = ["train.py", *argv]
    from slime.rollout.sglang_rollout import GenerateState
    from slime.utils.arguments import parse_args

    args = parse_args()
    sampling_params = GenerateState(args).sampling_params.copy()  # what slime's rollout hands each generate call
    with open(out, "wb") as f:
        pickle.dump((args, sampling_params), f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
