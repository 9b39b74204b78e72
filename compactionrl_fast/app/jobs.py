"""Framework jobs launched from here (`demo-verl`, the verl and slime job tests): a Ray of the job's own and the
job's output in a log file (their JSON-lines logs read back with `train.log.read_rows`)."""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time


@contextlib.contextmanager
def ray_folder(prefix="crfray"):
    """A temporary folder for the job's own Ray (a short path: Ray's socket names must stay under 108 bytes).
    On exit the processes whose command line names it (a Ray left by a job that died) are killed by that path,
    never by `ray stop`, which stops every Ray on the machine, and the folder goes."""
    path = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    try:
        yield path
    finally:
        subprocess.run(["pkill", "-9", "-f", path], capture_output=True)
        shutil.rmtree(path, ignore_errors=True)


def run_logged(cmd, log, *, env=None, cwd=None, timeout=None, poll=None):
    """Run `cmd` with its output (and, first, its command line) in the file `log`; (exit code, seconds).
    `poll`: called about every 2 s while it runs (e.g. a progress line read from the job's metrics)."""
    t = time.time()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            while True:
                try:
                    rc = p.wait(timeout=2)
                    break
                except subprocess.TimeoutExpired:
                    if timeout is not None and time.time() - t > timeout:
                        raise
                    if poll is not None:
                        poll()
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    if poll is not None:
        poll()
    return rc, time.time() - t
