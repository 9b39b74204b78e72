"""The package as a whole, each in a fresh interpreter: `import compactionrl_fast` is lazy (the ops only), and
every registered op traces (has a fake impl) besides its device kernels."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_import_is_lazy():
    """`import compactionrl_fast` loads the ops only: no transformers, no runtime, no trainer."""
    script = ("import sys, compactionrl_fast as c; bad = [m for m in ('transformers', 'compactionrl_fast.rollout', "
              "'compactionrl_fast.train', 'compactionrl_fast.integrations', 'compactionrl_fast.envs') if m in sys.modules];"
              " assert not bad, bad; c.PackedBatch; c.MemoryEnv; assert 'compactionrl_fast.envs' in sys.modules; print('ok')")
    p = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr[-2000:]


@pytest.mark.slow
def test_every_registered_op_has_a_fake_impl():
    """Every op of torch.ops.compactionrl_fast traces (fake/Meta) besides its device kernels."""
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "op_kernels.py")], capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert " 0 problems" in p.stdout, p.stdout[-3000:] + p.stderr[-2000:]
