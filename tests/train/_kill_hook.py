"""The fault test's kill switch, installed in the trainer process it starts (never in production code).

`install(at)` makes the at-th atomic write of this process (an int, 1-based: `atomic.atomic_write` and
`atomic.atomic_dir` calls, counted when their content is written), or the first write of a file or directory
named `at` (a str), SIGKILL the process half-way through: a file is cut to half its bytes and synced, a
directory is left filled under its temporary name, so the next start finds a real partial write.
"""
from __future__ import annotations

import contextlib
import os
import signal

from compactionrl_fast.train import atomic


def install(at) -> None:
    writes = [0]
    atomic_write, atomic_dir = atomic.atomic_write, atomic.atomic_dir

    def due(path) -> bool:
        writes[0] += 1
        return writes[0] == at if isinstance(at, int) else os.path.basename(os.fspath(path)) == at

    def kill(f=None):
        if f is not None:
            f.flush()
            f.truncate(max(f.tell() // 2, 1))
            os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)

    def write_then_maybe_kill(path, write, *, text=False):
        def fill(f):
            write(f)
            if due(path):
                kill(f)
        return atomic_write(path, fill, text=text)

    @contextlib.contextmanager
    def dir_then_maybe_kill(path):
        with atomic_dir(path) as tmp:
            yield tmp
            if due(path):
                kill()

    atomic.atomic_write, atomic.atomic_dir = write_then_maybe_kill, dir_then_maybe_kill
