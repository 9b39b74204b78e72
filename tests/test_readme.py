"""Every python block of the README runs, and prints what the README says it prints.

A runnable block (one that starts with an import) is followed by `<!-- output -->` and a `text` block
with its expected standard output; signature blocks are `text` blocks. Blocks run in a fresh namespace
each, with torch on one thread (the snippets are seeded: the output must not depend on the machine's
load or thread count)."""
from __future__ import annotations

import contextlib
import io
import os
import re

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = re.compile(r"```python\n(.*?)```(?:\s*<!-- output -->\s*```text\n(.*?)```)?", re.S)


def readme_blocks() -> list:
    """(code, expected output or None) of every python block of README.md."""
    text = open(os.path.join(ROOT, "README.md")).read()
    return [(m.group(1), m.group(2)) for m in BLOCK.finditer(text)]


def run_block(code: str) -> str:
    out = io.StringIO()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, "README.md block", "exec"), {"__name__": "__readme__"})
    finally:
        torch.set_num_threads(threads)
    return out.getvalue()


def test_readme_has_runnable_blocks():
    blocks = readme_blocks()
    assert len(blocks) >= 4
    for code, _ in blocks:
        assert code.lstrip().startswith(("import", "from")), "a python block that is not runnable: use ```text\n" + code


@pytest.mark.parametrize("i", range(len(readme_blocks())))
def test_readme_block_prints_its_documented_output(i):
    code, expected = readme_blocks()[i]
    assert expected is not None, f"python block {i} has no <!-- output --> text block after it"
    assert run_block(code) == expected


if __name__ == "__main__":  # print each block's actual output, to paste into the README after a change
    for i, (code, _) in enumerate(readme_blocks()):
        print(f"--- block {i}\n{run_block(code)}", end="")
