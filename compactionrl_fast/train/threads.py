"""`threads="auto"`: choose torch's CPU thread count from the wall time of the training steps themselves.

On a shared machine the best count changes with the load. On the idle 2-core machine two threads
make a demo step ~1.65x faster (SFT step 270 -> 165 ms); when another process holds the second core,
a second OpenMP thread mostly waits and steps get 2-7x slower. So every `period_s` seconds the tuner
runs `probe` steps at each candidate count and keeps the fastest (by the minimum over its probes, so a
one-off stall does not decide).

What the count changes: the last bits. MKL's matrix products split their sums by the threads they get
(and pick kernels by instruction set), so 1 and 2 threads give training passes that differ by a few
float32 ulps (tests/train/test_threads.py), which training amplifies (up to 7e-5 relative in the KL metrics
of the demo miniature after 3 PPO steps, 6e-4 between CPUs; its sampled tokens and evaluations stayed equal). Since the
tuner's choice depends on the load, "auto" runs are not bitwise reproducible by default; `threads=1`
runs are, on one machine, at any load. For bitwise equal results at any thread count, start the
process with MKL's strict conditional numerical reproducibility, `MKL_CBWR=AVX2,STRICT` (MKL reads it
at its first call: setting it after a matrix product has run does nothing): then 1 and 2 threads give
bitwise equal passes and demo runs (tests/train/test_threads.py, tests/test_demo_golden.py), at ~35%
more CPU time per single-thread step on an AVX-512 machine (benchmarks/results/repro-any-machine.md).
Across CPUs even that is not bitwise: ATen's own kernels are chosen by instruction set too.
"""
from __future__ import annotations

import os
import time
import warnings
from contextlib import contextmanager

import torch


class ThreadTuner:
    """Wraps each step (`with tuner.step(): ...`) and sets torch's intra-op thread count before it.

    Args:
        choices: candidate thread counts (default: 1 and the number of cores).
        probe: steps timed per candidate in a probing window.
        period_s: seconds between the end of one probing window and the start of the next.
    """

    def __init__(self, choices=None, probe: int = 2, period_s: float = 60.0):
        cores = os.cpu_count() or 1
        self.choices = sorted(set(choices or (1, cores)))
        if not self.choices or min(self.choices) < 1:
            raise ValueError(f"thread choices must be positive integers, got {choices!r}")
        self.probe, self.period_s = int(probe), float(period_s)
        self.best = self.choices[0]
        self._queue: list = []
        self._times: dict = {}
        self._last = -float("inf")  # end of the last probing window
        self.history: list = []  # (time, {threads: min seconds}, chosen) per window
        self.locked = False  # set_num_threads had no effect: the tuner stood down

    def _stand_down(self, wanted: int) -> None:
        """torch ignored set_num_threads (vLLM's CPU worker in this process makes it a no-op): stop probing
        and say so, rather than time and report counts that never took effect."""
        got = torch.get_num_threads()
        warnings.warn(f"threads='auto': torch.set_num_threads({wanted}) had no effect (torch keeps {got} threads; "
                      f"vLLM in this process does this); the tuner stands down at {got}", RuntimeWarning,
                      stacklevel=3)
        self.choices, self.best, self._queue, self.locked = [got], got, [], True

    @contextmanager
    def step(self):
        if not self._queue and len(self.choices) > 1 and time.perf_counter() - self._last >= self.period_s:
            self._queue = [c for c in self.choices for _ in range(self.probe)]
            self._times = {}
        n = self._queue[0] if self._queue else self.best
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        if torch.get_num_threads() != n:
            self._stand_down(n)
            yield torch.get_num_threads()
            return
        t = time.perf_counter()
        yield n
        if self._queue:
            self._times.setdefault(self._queue.pop(0), []).append(time.perf_counter() - t)
            if not self._queue:
                fastest = {c: min(ts) for c, ts in self._times.items()}
                self.best = min(fastest, key=fastest.get)
                self._last = time.perf_counter()
                self.history.append((self._last, fastest, self.best))


class SharedThreads:
    """The thread count of one of several job processes, read before each step from `value` (a
    multiprocessing.Value that the parent sets to cores // jobs still running), so that the job left running
    last takes the cores the others freed. `with shared.step() as n:` like ThreadTuner. The count a step runs
    at then depends on when the other jobs end, so such a job is not bitwise reproducible (as with the tuner)."""

    def __init__(self, value):
        self.value = value

    @contextmanager
    def step(self):
        n = max(1, int(self.value.value))
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        yield torch.get_num_threads()


def make_tuner(threads) -> ThreadTuner | None:
    """A ThreadTuner for `threads="auto"`; otherwise set a fixed count (0: torch's default) and return None."""
    if threads == "auto":
        return ThreadTuner()
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        raise ValueError(f"threads must be 'auto' or a non-negative integer, got {threads!r}")
    if threads:
        torch.set_num_threads(threads)
        if torch.get_num_threads() != threads:
            warnings.warn(f"threads={threads}: torch.set_num_threads had no effect, torch keeps "
                          f"{torch.get_num_threads()} threads", RuntimeWarning, stacklevel=2)
    return None


@contextmanager
def maybe_step(tuner: ThreadTuner | None):
    """`tuner.step()`, or nothing without a tuner."""
    if tuner is None:
        yield torch.get_num_threads()
    else:
        with tuner.step() as n:
            yield n
