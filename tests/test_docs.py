"""The README's runnable examples and the public ops' docstring examples still run."""
import doctest
import importlib
import os
import pkgutil
import re

import pytest

import compactionrl_fast.ops as ops_pkg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_examples():
    text = open(os.path.join(ROOT, "README.md")).read()
    # runnable blocks start with an import; signature blocks do not
    return [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if b.lstrip().startswith(("import", "from"))]


@pytest.mark.parametrize("i", range(len(readme_examples())))
def test_readme_example_runs(i):
    exec(compile(readme_examples()[i], f"README.md example {i}", "exec"), {})


@pytest.mark.parametrize("name", sorted(m.name for m in pkgutil.iter_modules(ops_pkg.__path__)
                                        if not m.name.startswith("_")))
def test_op_docstring_examples(name):
    mod = importlib.import_module(f"compactionrl_fast.ops.{name}")
    res = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    assert res.failed == 0
