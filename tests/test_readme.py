"""The README is a landing page, and every python example in it (and in docs/) prints what it says.

A runnable README block (one that starts with an import) is followed by `<!-- output -->` and a `text`
block with its expected standard output; signature blocks are `text` blocks. In docs/ only the blocks with
an `<!-- output -->` are run (the others may be sketches). Blocks run in a fresh namespace each, with torch
on one thread (the snippets are seeded: the output must not depend on the machine's load or thread count).

`python -m tests.test_readme` prints each block's actual output, to paste after a change."""
from __future__ import annotations

import contextlib
import glob
import io
import os
import re

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = re.compile(r"```python\n(.*?)```(?:\s*<!-- output -->\s*```text\n(.*?)```)?", re.S)
PUBLIC_OPS = ("segment_gae", "place_final_rewards", "ppo_policy_loss", "value_loss", "value_head", "value_head_loss",
              "linear_logprobs", "linear_logprobs_loss")
MAX_LINES = 155


def _read(path: str) -> str:
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def blocks(path: str) -> list:
    """(code, expected output or None) of every python block of the markdown file `path`."""
    return [(m.group(1), m.group(2)) for m in BLOCK.finditer(_read(path))]


def checked_blocks() -> list:
    """(label, code, expected) of every README block and every docs/ block that has an output."""
    out = [(f"README.md:{i}", c, e) for i, (c, e) in enumerate(blocks("README.md"))]
    for path in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        rel = os.path.relpath(path, ROOT)
        out += [(f"{rel}:{i}", c, e) for i, (c, e) in enumerate(blocks(rel)) if e is not None]
    return out


def run_block(code: str, label: str = "block") -> str:
    out = io.StringIO()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, label, "exec"), {"__name__": "__readme__"})
    finally:
        torch.set_num_threads(threads)
    return out.getvalue()


def test_readme_is_a_landing_page():
    text = _read("README.md")
    assert len(text.splitlines()) <= MAX_LINES, f"README.md has {len(text.splitlines())} lines (at most {MAX_LINES})"
    for heading in ("## Install", "## The two commands", "## The ops", "## Performance"):
        assert heading in text, heading
    # the two commands, as the Makefile defines them
    make = _read("Makefile")
    for target in ("demo", "test", "test-all"):
        assert f"make {target} " in text and f"\n{target}:" in make, target
    assert "benchmarks/results/demo_cpu.md" in text  # the recorded demo run


def test_every_public_op_has_a_runnable_example():
    code = "\n".join(c for c, _ in blocks("README.md"))
    missing = [op for op in PUBLIC_OPS if not re.search(rf"\bcrf\.{op}\(", code)]
    assert not missing, f"README has no example calling {missing}"


def test_readme_blocks_are_runnable_and_have_outputs():
    bs = blocks("README.md")
    assert len(bs) >= 4
    for code, expected in bs:
        assert code.lstrip().startswith(("import", "from")), "a python block that is not runnable: use ```text\n" + code
        assert expected is not None, "a python block without an <!-- output --> text block after it:\n" + code


def test_headline_table_names_command_and_revision():
    table = _read("README.md").split("## Performance", 1)[1]
    rows = [r for r in table.splitlines() if r.startswith("| `")]
    assert len(rows) >= 4
    for row in rows:  # a command (or "the same") and a git revision in every row
        assert re.search(r"\b[0-9a-f]{7}\b", row) or "the same" in row, row


@pytest.mark.parametrize("i", range(len(checked_blocks())))
def test_block_prints_its_documented_output(i):
    label, code, expected = checked_blocks()[i]
    assert run_block(code, label) == expected, label


if __name__ == "__main__":
    for label, code, _ in checked_blocks():
        print(f"--- {label}\n{run_block(code, label)}", end="")
