"""The modes table (kernels/modes.py) is the one definition of every mode's name and code: the C++ header is
generated from it at build time (never committed), the extension was compiled with the same codes, the package
takes its names from it, and the Triton kernels compare against its constants, not literals."""
import os
import re
import shutil
import subprocess
import sys
import types

import pytest

from compactionrl_fast.kernels import modes
from compactionrl_fast.ops import gae as ops_gae
from compactionrl_fast.ops._dispatch import cpp_ext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_header_is_generated_not_committed(tmp_path):
    """The builds write csrc/common/modes.h from the table: written when missing or stale, left alone (its time
    too, so nothing recompiles) when current; by kernels/modes.py run as a plain script, as CMake runs it."""
    os.makedirs(tmp_path / "csrc" / "common")
    path = tmp_path / modes.HEADER
    path.write_text("// stale\n")
    assert modes.write_header(str(tmp_path)) is True
    assert path.read_text() == modes.header()
    os.utime(path, (1, 1))
    assert modes.write_header(str(tmp_path)) is False
    assert path.stat().st_mtime == 1 and os.listdir(path.parent) == ["modes.h"]
    os.remove(path)
    script = os.path.join(ROOT, "kernels", "modes.py")
    out = subprocess.run([sys.executable, "-I", script, "--write-header"], capture_output=True, text=True,
                         cwd=tmp_path, check=True).stdout
    assert out.split()[-1] == os.path.join(ROOT, modes.HEADER)  # a script run writes the checkout's header
    with open(os.path.join(ROOT, modes.HEADER)) as f:
        assert f.read() == modes.header()
    if shutil.which("git") and os.path.exists(os.path.join(ROOT, ".git")):  # a checkout or a worktree (not a copy)
        tracked = subprocess.run(["git", "ls-files", modes.HEADER], cwd=ROOT, capture_output=True, text=True)
        ignored = subprocess.run(["git", "check-ignore", "-q", modes.HEADER], cwd=ROOT)
        assert tracked.stdout == "" and ignored.returncode == 0, f"{modes.HEADER} must be generated, not committed"


@pytest.mark.skipif(cpp_ext() is None, reason="the C++ extension is not built")
def test_extension_was_compiled_with_the_table():
    assert cpp_ext().MODES == {group: dict(table) for group, (table, _, _) in modes.TABLE.items()}


def test_every_mode_has_its_constant_and_dense_codes():
    for group, (table, prefix, _) in modes.TABLE.items():
        assert sorted(table.values()) == list(range(len(table))), group  # the C++ checks ranges
        for name, code in table.items():
            assert getattr(modes, modes.constant_name(prefix, name)) == code, (group, name)
    assert modes.cpp_name("LAM", "adaptive-rollout") == "kLamAdaptiveRollout"


def test_the_package_takes_its_names_from_the_table():
    assert ops_gae.CROSS_MODES is modes.CROSS_SEGMENT
    assert (ops_gae.LAM_CONST, ops_gae.LAM_ADAPTIVE_SEGMENT, ops_gae.LAM_ADAPTIVE_ROLLOUT, ops_gae.LAM_TENSOR) == \
        (modes.LAM_CONST, modes.LAM_ADAPTIVE_SEGMENT, modes.LAM_ADAPTIVE_ROLLOUT, modes.LAM_TENSOR)


# a mode compared with a number: `LAM_MODE == 3`, `REDUCTION != 0`, `reduction == 2 and ...`
_LITERAL = re.compile(r"\b(LAM_MODE|CROSS|REDUCTION|reduction)\s*[=!]=\s*\d")


def test_the_literal_pattern_catches_literals():
    for bad in ("if LAM_MODE == 3:", "elif REDUCTION != 3:", "ROLLOUTS = REDUCTION==2 and HAS_CS",
                "rollouts = reduction == 2 and cu_segments is not None", "if CROSS == 1:"):
        assert _LITERAL.search(bad), bad
    for good in ("if LAM_MODE == modes.LAM_TENSOR:", "elif REDUCTION != modes.REDUCTION_SUM:", "if DEN == 2:"):
        assert not _LITERAL.search(good), good


def test_kernels_compare_modes_by_name():
    """`LAM_MODE == modes.LAM_TENSOR`, never `LAM_MODE == 3`, in the Triton kernels and their launchers (and in
    ops/_reduction.py, which picks the weights kernel's launches)."""
    files = [os.path.join("kernels", n) for n in sorted(os.listdir(os.path.join(ROOT, "kernels"))) if n.endswith(".py")]
    for path in files + [os.path.join("compactionrl_fast", "ops", "_reduction.py")]:
        with open(os.path.join(ROOT, path)) as f:
            assert not _LITERAL.search(f.read()), f"{path} compares a mode with a literal"


def test_each_cross_mode_says_its_help_rewards_and_counts():
    """What the trainer, packing and the kernels' launchers read about a cross_segment mode is in the table."""
    names = set(modes.CROSS_SEGMENT)
    assert set(modes.CROSS_SEGMENT_HELP) == names
    assert set(modes.CROSS_REWARDS) == names and set(modes.CROSS_REWARDS.values()) <= set(modes.REWARD_PLACEMENT)
    assert set(modes.CROSS_COUNTED) <= set(modes.CROSS_SEGMENT.values())
    assert set(modes.LAM_COUNTED) <= set(modes.LAMBDA.values())
    assert set(modes.REDUCTION_HELP) <= set(modes.REDUCTION)
    for cross in modes.CROSS_SEGMENT.values():
        for lam in modes.LAMBDA.values():
            assert modes.needs_counts(lam, cross) == (cross in modes.CROSS_COUNTED or lam in modes.LAM_COUNTED)


def test_config_help_and_choices_come_from_the_table():
    import dataclasses

    from compactionrl_fast.train.config import TrainConfig
    from compactionrl_fast.train.micro_batch import reward_mode

    f = {x.name: x for x in dataclasses.fields(TrainConfig)}
    for key, table, described in (("cross_segment", modes.CROSS_SEGMENT, modes.CROSS_SEGMENT_HELP),
                                  ("loss_reduction", modes.REDUCTION, modes.REDUCTION_HELP)):
        help_ = f[key].metadata["help"]
        assert help_.startswith(" | ".join(list(described) + [n for n in table if n not in described]) + ": ")
        assert all(f"{n}: {d}" in help_ for n, d in described.items())
        for name in table:
            assert f[key].metadata["check"](name) is None, (key, name)
        assert f[key].metadata["check"]("no-such-mode") is not None
    for name, placement in modes.CROSS_REWARDS.items():
        assert reward_mode(types.SimpleNamespace(cross_segment=name)) == placement
