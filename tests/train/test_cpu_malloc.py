"""`keep_freed_memory`: glibc keeps freed activation buffers, so a training loop stops page-faulting them in."""
import os
import platform
import subprocess
import sys

import pytest

from compactionrl_fast.app import demo
from compactionrl_fast.train import cpu_malloc

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

# a step's pattern: activations written, then all freed; the minor page faults of 10 such rounds after 10 more.
# 40 MiB buffers: above the 32 MiB cap of glibc's dynamic mmap threshold, so glibc's default maps and unmaps
# them every round whatever the process did before (smaller ones fault or not by the allocation history)
_LOOP = """
import resource, torch
from compactionrl_fast.train.cpu_malloc import keep_freed_memory
set_ = keep_freed_memory()
def step():
    xs = [torch.empty(10 << 20).fill_(1.0) for _ in range(2)]
    del xs
for _ in range(10):  # the heap grows to the pattern's need (kept), then serves it
    step()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(set_, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def _faults(env_value):
    env = {k: v for k, v in os.environ.items() if k != "COMPACTIONRL_FAST_MALLOC"}
    if env_value is not None:
        env["COMPACTIONRL_FAST_MALLOC"] = env_value
    out = subprocess.run([sys.executable, "-c", _LOOP], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    set_, faults = out.stdout.split()
    return set_ == "True", int(faults)


@glibc
def test_fixed_thresholds_stop_the_page_faults_of_freed_buffers():
    set_default, default = _faults("default")
    set_kept, kept = _faults(None)
    assert not set_default and set_kept
    # default: 2 x 10240 faults a round; kept: the heap's pages are reused (0 faults here)
    assert default > 10 * 2 * 10000, default
    assert kept < default / 10, (kept, default)


@glibc
def test_keep_freed_memory_sets_both_thresholds(monkeypatch):
    monkeypatch.delenv("COMPACTIONRL_FAST_MALLOC", raising=False)
    assert cpu_malloc.keep_freed_memory() is True
    monkeypatch.setenv("COMPACTIONRL_FAST_MALLOC", "default")
    assert cpu_malloc.keep_freed_memory() is False


def test_demo_workers_keep_freed_memory_on_cpu_only(monkeypatch):
    calls = []
    monkeypatch.setattr(demo, "keep_freed_memory", lambda: calls.append(1) or True)
    monkeypatch.setattr(demo.torch, "set_num_threads", lambda n: None)
    demo._worker_init(1, False)
    assert calls == []
    demo._worker_init(1, True)
    assert calls == [1]
