"""The modes table (kernels/modes.py) is the one definition of every mode's name and code: the committed
C++ header is the one it generates, the extension was compiled with the same codes, the package takes its
names from it, and the Triton kernels compare against its constants, not literals."""
import os
import re

import pytest

from compactionrl_fast.kernels import modes
from compactionrl_fast.ops import gae as ops_gae
from compactionrl_fast.ops._dispatch import cpp_ext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_committed_header_is_the_generated_one():
    with open(os.path.join(ROOT, modes.HEADER)) as f:
        assert f.read() == modes.header(), f"{modes.HEADER} is stale: run `python -m kernels.modes --write-header`"


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


def test_gae_kernels_compare_modes_by_name():
    """`LAM_MODE == modes.LAM_TENSOR`, never `LAM_MODE == 3`, in the Triton kernels."""
    literal = re.compile(r"\b(LAM_MODE|CROSS)\s*[=!]=\s*\d")
    for name in sorted(os.listdir(os.path.join(ROOT, "kernels"))):
        if name.endswith(".py"):
            with open(os.path.join(ROOT, "kernels", name)) as f:
                assert not literal.search(f.read()), f"kernels/{name} compares a mode with a literal"
