"""Bad offsets never crash a kernel: with the value checks off, every backend gives a clear error or some
numbers on every bad layout (in a subprocess: a segfault fails the test, not pytest); the raw C++ op checks
the offsets itself."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from compactionrl_fast.ops import _dispatch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


BAD_OFFSETS = {"decreasing": [0, 7, 4, 10], "past_T": [0, 4, 7, 1 << 30], "huge": [0, 4, 1 << 40, 10],
               "negative": [0, -3, 7, 10], "last_short": [0, 4, 7, 9]}


@pytest.mark.slow
@pytest.mark.parametrize("backend", [b for b in ("cpp", "triton", "torch") if b in _dispatch.available(torch.device("cpu"))])
def test_bad_offsets_with_checks_off_never_crash(backend):
    """COMPACTIONRL_FAST_CHECKS=0: every bad layout gives a clear error or some numbers, in a subprocess
    (a segfault must fail this test, not kill pytest)."""
    script = textwrap.dedent(f"""
        import torch, compactionrl_fast as crf
        T = 10
        mask = torch.tensor([0, 1, 1, 1, 0, 1, 1, 0, 1, 1], dtype=torch.bool)
        x = torch.linspace(-1, 1, T)
        for name, cu in {BAD_OFFSETS!r}.items():
            for idx in (torch.int32, torch.int64):
                if idx == torch.int32 and max(abs(c) for c in cu) >= 2**31:
                    continue
                cu_t = torch.tensor(cu, dtype=idx)
                cs = torch.tensor([0, 2, 3], dtype=idx)
                for op in ("gae", "rewards", "ppo", "value"):
                    try:
                        if op == "gae":
                            crf.segment_gae(x, x, mask, cu_t, cs, backend={backend!r})
                        elif op == "rewards":
                            crf.place_final_rewards(torch.ones(2), mask, cu_t, cs)
                        elif op == "ppo":
                            crf.ppo_policy_loss(x, x, x, mask, cu_seqlens=cu_t, cu_segments=cs, reduction="segment-mean",
                                                backend={backend!r})
                        else:
                            crf.value_loss(x, x, x, mask, cu_seqlens=cu_t, cu_segments=cs, reduction="rollout-mean",
                                           backend={backend!r})
                    except (ValueError, TypeError, IndexError, RuntimeError) as e:
                        pass
        print("survived")
    """)
    env = dict(os.environ, COMPACTIONRL_FAST_CHECKS="0", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and "survived" in p.stdout, f"rc={p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"


def test_raw_cpp_gae_op_rejects_bad_offsets():
    if not hasattr(torch.ops.compactionrl_fast, "segment_gae") or _dispatch.cpp_ext() is None:
        pytest.skip("needs the compiled extension")
    x, mask = torch.zeros(10), torch.ones(10, dtype=torch.bool)
    for cu in ([0, 4, 1 << 40, 10], [0, 7, 4, 10], [0, 4, 7, 1 << 30]):
        with pytest.raises(ValueError, match="cu_seqlens"):
            torch.ops.compactionrl_fast.segment_gae(x, x, mask, torch.tensor(cu), torch.tensor([0, 3]), None, 1.0, 1.0,
                                                    0, 1.5, 1, 1.0)
